"""KFP v2 lightweight components: thin adapters from artifacts and parameters to one ``persia_core`` call each.

The image that runs them holds the project (``persia_core`` and its requirements); it is a compile-time setting,
``$PERSIA_BASE_IMAGE``. Under ``kfp.local.SubprocessRunner`` the image is ignored and the components run in the
caller's environment, where the project is installed.
"""

import os

BASE_IMAGE = os.environ.get("PERSIA_BASE_IMAGE", "python:3.11-slim")
