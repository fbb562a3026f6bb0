"""Fixtures of the Vertex AI tests: the Cloud Storage emulator, which ``PipelineJob.submit`` talks to when it
checks (and creates) the pipeline root's bucket."""

import pytest
from gcs.emulator import PROJECT_NUMBER, running_emulator


@pytest.fixture(scope="session")
def gcs_emulator():
    with running_emulator() as url:
        yield url


@pytest.fixture
def offline_aiplatform(monkeypatch):
    """google.cloud.aiplatform with anonymous credentials, project ``test-project`` (number: the emulator's
    buckets' ``PROJECT_NUMBER``; the Resource Manager lookup is replaced) and fresh global settings (restored
    afterwards)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud.aiplatform import initializer
    from google.cloud.aiplatform.utils import resource_manager_utils

    monkeypatch.setattr(resource_manager_utils, "get_project_number", lambda *a, **k: PROJECT_NUMBER)

    for var in ("GOOGLE_CLOUD_PROJECT", "CLOUD_ML_PROJECT_ID", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("google.auth.default", lambda *a, **k: (AnonymousCredentials(), "test-project"))
    for attr in ("_project", "_location", "_credentials", "_staging_bucket", "_service_account", "_network"):
        if hasattr(initializer.global_config, attr):
            monkeypatch.setattr(initializer.global_config, attr, None)
