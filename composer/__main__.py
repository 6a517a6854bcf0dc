"""`python -m composer`: the command line."""

from composer.cli import main

main()
