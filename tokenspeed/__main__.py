from tokenspeed.entrypoints.cli import main

main()
