"""The TFRecord tests run in their own environment, .venv-tfrecord (``make test-tfrecord``): tensorflow 2.16 and
tensorflow-io cannot be installed beside kfp and apache-beam[gcp] (see requirements-tfrecord.txt).

In the main environment (``make test``) this folder is not collected. ``make test-tfrecord`` sets
``PERSIA_TFRECORD_REQUIRED=1``, so there a missing tensorflow is an error, not a silent pass.
"""

import importlib.util
import os

if importlib.util.find_spec("tensorflow") is None:
    if os.environ.get("PERSIA_TFRECORD_REQUIRED") == "1":
        raise RuntimeError(
            "PERSIA_TFRECORD_REQUIRED=1 but tensorflow is not importable: run the TFRecord tests "
            "with .venv-tfrecord/bin/python (make test-tfrecord)"
        )
    collect_ignore_glob = ["test_*.py"]
