from rlgate.cli import main

main()
