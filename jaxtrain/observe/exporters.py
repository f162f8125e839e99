"""Optional exporters of a run's records to the monitoring a team already runs: MLflow (``log.mlflow``), Weights &
Biases (``log.wandb``) and Prometheus (``log.prometheus_port``). ``MetricsLog`` (metrics.py) feeds them on process 0; each package is
imported only when its key is set (config.log_problems checks it is installed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path

from jaxtrain import config as config_lib
from jaxtrain.atomic import atomic_file
from jaxtrain.config import Config
from jaxtrain.distributed import bind_error_reason, port_problem
from jaxtrain.errors import UserError

MLFLOW_RUN_ID_FILE = "mlflow_run_id"  # in the run directory: a resumed run continues the same MLflow run
MLFLOW_PARAMS_PER_BATCH = 100  # the most params MLflow's log_batch takes at once
MLFLOW_CLOSE_TIMEOUT_S = 30  # at the end, the wait for an MLflow server still working through the run's calls
PLOT_FILE = "metrics.png"
WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run continues the same W&B run


def start_wandb(cfg: Config, run_dir: Path):
    """The run directory's W&B run: a new one the first time, the same one (``resume="allow"``) on every resume, as
    MLflow's (each resume started a new W&B run, a QA report). Steps a killed run logged past its checkpoint are logged
    again, which W&B ignores below the run's last step: the first attempt's values stay."""
    import wandb

    id_file = run_dir / WANDB_RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    run = wandb.init(project=cfg.log.wandb, name=run_dir.name, dir=str(run_dir), config=config_lib.to_dict(cfg), id=run_id,
                     resume="allow")
    if not id_file.is_file():
        with atomic_file(id_file, "W&B run id") as f:  # whole or not at all: an empty one, read back, began another W&B run
            f.write(f"{run_id}\n".encode())
    return run


class MlflowRun:
    """One MLflow run per run directory (``MLFLOW_TRACKING_URI`` picks the server or store): the resolved
    config as params, the records' scalars as metrics, ``config.yaml`` and the plot as artifacts at the end.

    The run is opened before training (``check_mlflow`` found the store answering moments before); everything after
    goes to the server from a thread of its own, in order. A server that stops answering costs the run one warning,
    never a stalled or failed step: MLflow retries a request for minutes, and in the step loop that froze training,
    then ended it with a traceback and no checkpoint (a QA report)."""

    def __init__(self, cfg: Config, run_dir: Path):
        import mlflow
        from mlflow.entities import Param

        self.client, self.run_dir, self.uri = mlflow.MlflowClient(), run_dir, mlflow.get_tracking_uri()
        # urllib3 logs a line per retry of every unanswered request: the one warning below says it instead
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        id_file = run_dir / MLFLOW_RUN_ID_FILE
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(cfg.log.mlflow)
            experiment = found.experiment_id if found else self.client.create_experiment(cfg.log.mlflow)
            self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
            with atomic_file(id_file, "MLflow run id") as f:  # whole or not at all, as W&B's
                f.write(f"{self.run_id}\n".encode())
            # MLflow refuses to change a param, so a resumed run keeps the ones it started with
            params = [Param(key, str(value)) for key, value in config_lib.flatten(config_lib.to_dict(cfg)).items()]
            for start in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_PARAMS_PER_BATCH])
        self.calls: queue.Queue = queue.Queue()
        self.unsent = 0
        self.sender = threading.Thread(target=self._send, name="jaxtrain-mlflow", daemon=True)
        self.sender.start()

    def _send(self) -> None:
        while (call := self.calls.get()) is not None:
            what, send = call
            try:
                send()
            except Exception as e:  # noqa: BLE001 -- whatever the client raises, training goes on
                self.unsent += 1
                if self.unsent == 1:
                    first = str(e).strip().split("\n")[0][:200]
                    print(f"jaxtrain: warning: MLflow at {self.uri} did not take {what} ({type(e).__name__}: {first}); training goes "
                          "on, and the records are in metrics.jsonl and TensorBoard", file=sys.stderr, flush=True)

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        self.calls.put((f"step {step}'s metrics", lambda: self.client.log_batch(self.run_id, metrics=metrics)))

    def close(self, status: str) -> None:
        """``status``: FINISHED, KILLED (preempted) or FAILED. Waits at most ``MLFLOW_CLOSE_TIMEOUT_S`` for the server.
        MLflow's own asynchronous logging (``synchronous=False``) would wait for its queue at exit without a limit."""
        try:
            if (self.run_dir / "metrics.jsonl").stat().st_size:
                from jaxtrain.observe.plot import plot_runs

                plot_runs([self.run_dir], self.run_dir / PLOT_FILE)
                self.calls.put(("the plot", lambda: self.client.log_artifact(self.run_id, str(self.run_dir / PLOT_FILE))))
        finally:  # the run's end is sent whatever the plot did
            self.calls.put(("config.yaml", lambda: self.client.log_artifact(self.run_id, str(self.run_dir / "config.yaml"))))
            self.calls.put((f"the run's end ({status})", lambda: self.client.set_terminated(self.run_id, status)))
            self.calls.put(None)
            self._wait(status)

    def _wait(self, status: str) -> None:
        self.sender.join(MLFLOW_CLOSE_TIMEOUT_S)
        if self.sender.is_alive():  # the queue's size: the calls waiting, with the end marker for the one in flight
            print(f"jaxtrain: warning: MLflow at {self.uri} did not answer within {MLFLOW_CLOSE_TIMEOUT_S} s at the end: "
                  f"{self.calls.qsize()} of this run's calls, its end ({status}) among them, were not sent; the records are "
                  "in metrics.jsonl and TensorBoard", file=sys.stderr, flush=True)
        elif self.unsent > 1:
            print(f"jaxtrain: warning: MLflow at {self.uri} did not take {self.unsent} of this run's calls", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _answer_soon():
    """MLflow's requests, unless the user set otherwise, tried once for at most 10 s: by default an unreachable
    server takes minutes of retries to report."""
    settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    added = {key: value for key, value in settings.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def check_mlflow(experiment: str, run_dir: Path) -> None:
    """Before the compile and the run directory: the tracking store MLflow would use (``MLFLOW_TRACKING_URI``, or
    its default, a sqlite file that ``mlflow-skinny`` cannot open) answers, the experiment is not deleted there, and
    a resumed run's MLflow run is there. Only reads the store."""
    import mlflow

    with _answer_soon():
        _check_mlflow(mlflow, experiment, run_dir)


def _check_mlflow(mlflow, experiment: str, run_dir: Path) -> None:
    uri = mlflow.get_tracking_uri()
    try:
        found = mlflow.MlflowClient(uri).get_experiment_by_name(experiment)
    except mlflow.exceptions.MlflowException as e:
        first = str(e).strip().split("\n")[0].split(". ")[0][:200]  # the gist; MLflow's messages run to paragraphs
        default = "" if os.environ.get("MLFLOW_TRACKING_URI") else ", MLflow's default without MLFLOW_TRACKING_URI"
        raise UserError(f"log.mlflow={experiment}: cannot use the MLflow tracking URI {uri}{default} ({type(e).__name__}: "
                        f"{first}); set MLFLOW_TRACKING_URI to an MLflow server (http://HOST:PORT), or for a local store "
                        "to file:///PATH/mlruns with MLFLOW_ALLOW_FILE_STORE=true (MLflow 3's opt-in)") from None
    if found is not None and found.lifecycle_stage == "deleted":  # MLflow would refuse to log to it
        raise UserError(f"log.mlflow={experiment}: that experiment is deleted in the MLflow tracking store {uri}; "
                        "restore it there or choose another name")
    id_file = run_dir / MLFLOW_RUN_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip()
        try:
            mlflow.MlflowClient(uri).get_run(run_id)
        except mlflow.exceptions.MlflowException:
            raise UserError(f"{id_file} names MLflow run {run_id}, which the tracking store {uri} does not have; point "
                            "MLFLOW_TRACKING_URI at the store this run started in, or delete that file to start a new "
                            "MLflow run") from None


def check_port_free(port: int) -> None:
    """Before the run directory is touched: ``log.prometheus_port`` must be free to serve on."""
    if (why := port_problem(port)) is not None:
        raise _port_error(port, why)


def _port_error(port: int, why: str) -> UserError:
    return UserError(f"log.prometheus_port={port}: cannot serve metrics there ({why}); choose a free port or drop log.prometheus_port")


# a step record's counts of updates not applied (each present only where its guard is on)
SKIPPED_UPDATE_COUNTS = ("skipped_nonfinite_steps", "overflow_steps", "skipped_spikes")


class PrometheusGauges:
    """Process 0 serves the latest record as gauges at ``http://HOST:PORT/metrics``, so a cluster's Prometheus
    sees a stalled run (the step and checkpoint age stop moving) or a diverging one (the loss)."""

    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()  # this run's gauges only, not the process's default ones

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"jaxtrain_{name}", doc, registry=self.registry)

        self.gauges = {
            "step": gauge("step", "latest step with a metrics record"),
            "loss": gauge("loss", "training loss (nats per token) at that step"),
            "epoch": gauge("epoch", "epochs of the training split read through that step's batch"),
            "tokens_per_s": gauge("tokens_per_second", "global training throughput"),
            "mfu": gauge("mfu", "model FLOPs utilisation (0-1); NaN when the device peak is unknown"),
            "memory_in_use_gib": gauge("memory_in_use_gib", "memory in use on the fullest device (host RSS on CPU), GiB"),
            "memory_peak_gib": gauge("memory_peak_gib", "peak memory of the fullest device (host RSS on CPU), GiB"),
        }
        self.skipped_updates = gauge("skipped_updates", "updates not applied since the run (re)started: non-finite "
                                     "(train.skip_nonfinite), float16 overflows, spikes (train.skip_spikes)")
        self.checkpoint_step = gauge("last_checkpoint_step", "step of the latest checkpoint committed (written whole); NaN before one")
        # NaN until known: a 0 loss or step would read as one
        for unknown in (*self.gauges.values(), self.skipped_updates, self.checkpoint_step):
            unknown.set(float("nan"))
        self.checkpoint_time = None
        gauge("last_checkpoint_age_seconds", "seconds since that checkpoint's save started; NaN before one").set_function(
            lambda: float("nan") if self.checkpoint_time is None else time.time() - self.checkpoint_time)
        try:
            self.server, _ = start_http_server(port, registry=self.registry)
        except OSError as e:
            raise _port_error(port, bind_error_reason(e)) from None

    def record(self, record: dict) -> None:
        for key, gauge in self.gauges.items():
            value = record.get(key)
            gauge.set(float("nan") if value is None else value)
        self.skipped_updates.set(sum(record.get(key) or 0 for key in SKIPPED_UPDATE_COUNTS))

    def checkpoint(self, step: int, written: float) -> None:
        self.checkpoint_step.set(step)
        self.checkpoint_time = written

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
