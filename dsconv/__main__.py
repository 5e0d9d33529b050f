from dsconv.cli import main

main()
