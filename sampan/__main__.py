from sampan.cli import main

main()
