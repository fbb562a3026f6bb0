"""KFP v2 lightweight components: thin adapters from artifacts and parameters to one ``persia_core`` call each.

One file per component: ``preprocess``, ``init_shards``, ``train`` (local target) or ``vertex_train`` (Vertex AI:
a CustomJob), ``evaluate``, ``gate`` (with ``bless_model``), ``resolve_data`` (Vertex AI's step 0) and ``deploy``
(Vertex AI, optional). The Vertex AI steps call the components-local modules ``custom_job`` (the CustomJob
request), ``data_path`` (the scheduled run's data path) and ``endpoint`` (Model Registry and endpoint requests);
nothing here imports ``pipelines``, which passes in the compile-time settings.

The image that runs them holds the project (``persia_core`` and its requirements; see ``Dockerfile``); it is a
compile-time setting, ``$PERSIA_BASE_IMAGE``, read when this package is imported and again by
``base_image(target)`` when a target is compiled:

    local target   $PERSIA_BASE_IMAGE, else ``LOCAL_IMAGE`` (the tag ``make image`` builds). Under
                   ``kfp.local.SubprocessRunner`` the image is ignored: components run in the caller's
                   environment, where the project is installed.
    vertex target  $PERSIA_BASE_IMAGE is required (an image pushed to a registry Vertex AI can pull); without it
                   the compile fails with a clear message instead of naming an image nobody built.
"""

import os

IMAGE_ENV = "PERSIA_BASE_IMAGE"
LOCAL_IMAGE = "persia-kfp:local"
"""The tag ``make image`` builds from ``Dockerfile``."""


def base_image(target: str = "local") -> str:
    """The components' image for ``target`` (``local`` | ``vertex``). Raises ``ValueError`` for a Vertex AI
    target without ``$PERSIA_BASE_IMAGE`` or an unknown target."""
    if target not in ("local", "vertex"):
        raise ValueError(f"unknown target {target!r} (expected 'local' or 'vertex')")
    image = os.environ.get(IMAGE_ENV, "").strip()
    if image:
        return image
    if target == "vertex":
        raise ValueError(
            f"a Vertex AI compile needs ${IMAGE_ENV}: the URI of the pushed project image, e.g. "
            f"us-central1-docker.pkg.dev/PROJECT/persia/persia-kfp:TAG (build and push it with "
            f"`make image` or cloudbuild.yaml; see README 'Run on Google Cloud')"
        )
    return LOCAL_IMAGE


BASE_IMAGE = base_image("local")
