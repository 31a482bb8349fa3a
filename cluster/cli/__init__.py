"""The `pdserve` command and its subcommands (the only code that reads the
command line)."""
