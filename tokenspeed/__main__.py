from tokenspeed.cli.main import main

main()
