"""The ``persia`` command's subcommands, one module per group (``persia_core.__main__`` parses and dispatches).

    common.py   exit codes, the run config from ``--config``/``--set``, JSON output
    steps.py    preprocess, init-shards, train       (the pipeline's steps)
    scoring.py  evaluate, predict                    (a Model on data)
    shards.py   plan, serve-shards                   (capacity planning, parameter servers by hand)
    serving.py  serve                                (an HTTP prediction server for a Model)

Each group's ``add_commands(add)`` adds its subcommands' parsers; each ``cmd_*`` function imports what it runs
inside, so that ``persia --help`` loads no torch, Beam or gRPC.
"""
