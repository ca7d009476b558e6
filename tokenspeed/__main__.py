from tokenspeed.cli import main

main()
