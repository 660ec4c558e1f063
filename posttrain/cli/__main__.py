"""``python -m posttrain.cli`` (as ``torchrun`` and ``accelerate launch`` name a module) runs the CLI."""

from posttrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
