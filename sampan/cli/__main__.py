"""``python -m sampan.cli``."""

from sampan.cli import main

main()
