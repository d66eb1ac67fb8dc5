"""`python -m shardcast ...` is the `shardcast` command: the console script's entry, the same C++ binary."""
from ._cli import main

main()
