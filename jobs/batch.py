"""The embedding job as a Ray actor of its own, for the service's Batch API (service/apis/openai_batch/runner.py).

A batch's /v1/embeddings lines run as `jobs.embed.run` inside a detached, named actor in the service's Ray
cluster, beside the Serve application and outside any replica. Named after the batch (get_if_exists), so a
restarted service, or another replica, finds the running job instead of starting a second; detached, so it
outlives the replica that started it; killed (with the actors its Ray Data pipeline owns) on cancel. The
job's output directory is resumable (jobs/shards.py): a job started again after a lost cluster skips the
ranges done.
"""

from __future__ import annotations

import threading

from jobs.embed import bad_text
from jobs.shards import begun_with, read_records, shard_path

NAMESPACE = "openai-batch"  # the batch jobs' actors, apart from Serve's namespace


class EmbedJobActor:
    """Runs one embedding job on a thread of its own, so that `state` answers while it runs."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.summary: dict | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="embed-job", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from jobs.embed import run

        try:
            self.summary = run(self.spec)
        except BaseException as exc:  # noqa: BLE001 - said to the runner, which falls back to the replica
            self.error = f"{type(exc).__name__}: {exc}"

    def state(self) -> dict:
        return {"done": not self.thread.is_alive(), "summary": self.summary, "error": self.error}


def actor_name(batch_id: str) -> str:
    return f"embed-{batch_id}"


def start_job(batch_id: str, spec: dict):
    """The batch's job actor: the running one if any (this cluster), else a new one started on `spec`. It
    takes no CPU slot of its own (it drives the pipeline and waits); the pipeline's actors take
    spec['num_cpus'] each."""
    import ray

    remote = ray.remote(EmbedJobActor).options(
        name=actor_name(batch_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=0, max_concurrency=4)
    return remote.remote(spec)


def stop_job(batch_id: str) -> None:
    """Kill the batch's job actor, if it runs (the pipeline's actors die with it, their owner)."""
    import ray

    try:
        ray.kill(ray.get_actor(actor_name(batch_id), namespace=NAMESPACE), no_restart=True)
    except ValueError:  # none by that name: never started here, or already stopped
        pass


def stop_job_if_any(batch_id: str) -> None:
    """Stop the batch's job actor where this process is in a Ray cluster (never starts one)."""
    import ray

    if ray.is_initialized():
        stop_job(batch_id)


class BatchJobs:
    """What the Batch API's runner (service/apis/openai_batch/runner.py) uses of the embedding job, in one
    place: service/deployment.py hands it to the runner, so the service's layers never import jobs/ (the job
    sits above the engine it runs, and the runner below the composition that knows both)."""

    start = staticmethod(start_job)  # (batch id, spec) -> the job's actor, running or new
    stop = staticmethod(stop_job)
    stop_if_any = staticmethod(stop_job_if_any)
    begun_with = staticmethod(begun_with)  # what the job that began an output was made with
    records = staticmethod(read_records)  # the ranges done, from the output's _progress
    shard_path = staticmethod(shard_path)
    bad_text = staticmethod(bad_text)  # why the job would not embed a text (those lines run in process)
