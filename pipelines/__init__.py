"""The persia-kfp pipeline: its definition and compile entry point (``persia_pipeline``), the Vertex AI target's
compile-time settings (``vertex``), a local run with kfp.local (``run_local``) and submission to Vertex AI
(``submit``, the CLI, over ``parameters``, ``jobs`` and ``schedules``)."""
