"""Starting models: built-in tiny models built from a recipe and cached (see :mod:`posttrain.models.tiny`)."""
