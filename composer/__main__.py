"""`python -m composer`: the command line."""

from composer.cli.main import main

main()
