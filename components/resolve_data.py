"""Step 0 of the Vertex AI pipeline: the run's data path from its scheduled time (``components.data_path``)."""

from kfp import dsl

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def resolve_data(template: str, schedule_time: str, blessed_dir: str = "", warm_start_from: str = "") -> str:
    """The data path of this run: ``{date...}`` tokens of ``template`` filled from the scheduled time (the
    current time for a run that was not scheduled). First step of the Vertex AI pipeline, so it also fails the
    run at once (not after training) when ``blessed_dir`` or ``warm_start_from`` is not on Cloud Storage: a
    folder inside the step's container is gone when the step ends (runs started from the UI are not checked
    by ``pipelines.submit``), or when ``warm_start_from`` names nothing and is not ``blessed_dir`` (a typo that
    would start every scheduled run cold: ``check_warm_start_location``)."""
    from components.data_path import check_cloud_folders, resolve_data_path

    check_cloud_folders(blessed_dir, warm_start_from)
    from persia_core.embedding.warm_start import check_warm_start_location

    check_warm_start_location(warm_start_from, blessed_dir)
    path = resolve_data_path(template, schedule_time)
    print(f"data: {path}")
    return path
