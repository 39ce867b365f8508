from mmsplit_cli.main import main

main()
