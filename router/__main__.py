"""`python -m router`: the PD router."""

from router.cli import main

if __name__ == "__main__":
    main()
