# `python -m ovkit ...` and `accelerate launch -m ovkit ...` enter here.
from ovkit.cli import main

if __name__ == "__main__":
    main()
