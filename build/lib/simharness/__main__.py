from simharness.cli import main

main()
