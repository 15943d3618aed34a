"""`python -m stagereplay.cli ...`, as the `stagereplay` command."""

from stagereplay.cli import main

main()
