"""`python -m scaffold` is the `scaffold` command."""

from scaffold._cli import main

if __name__ == "__main__":
    main()
