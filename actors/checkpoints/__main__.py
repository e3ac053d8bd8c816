"""`python -m actors.checkpoints RECIPE OUT_DIR`: see actors/checkpoints/build.py."""

from actors.checkpoints.build import main

main()
