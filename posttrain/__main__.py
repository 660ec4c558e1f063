"""``python -m posttrain`` runs the CLI, like the ``posttrain`` command."""

from posttrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
