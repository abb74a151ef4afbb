from shardserve.cli import main

main()
