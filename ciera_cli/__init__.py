"""The `ciera` console script. It only mounts the subcommands each stage package owns."""
