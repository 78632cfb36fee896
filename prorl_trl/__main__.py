"""`python -m prorl_trl ...` is the `prorl-trl` command (works under `accelerate launch -m prorl_trl`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
