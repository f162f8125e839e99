"""The cluster templates give `jaxtrain train` the right multi-process flags: the SLURM batch script and the
Kubernetes entrypoint run against a fake environment and a stand-in `jaxtrain` that prints its arguments;
the Kubernetes manifest's parts agree with each other; the local launcher reports the process that failed and
forwards a Ctrl-C once."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO

K8S = REPO / "scripts" / "k8s"
USER_ARGS = ["llama3_70b", "--mesh", "h100x64", "--run-dir", "/shared/runs/x", "data.path=/shared/tokens.bin"]


def _fake_commands(tmp_path, **scripts) -> dict:
    """An environment whose PATH finds the given stand-in commands first."""
    for name, body in scripts.items():
        path = tmp_path / name
        path.write_text(body if body.startswith("#!") else "#!/bin/bash\n" + body)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "NUM_PROCESSES", "COORDINATOR"))}
    return env | {"PATH": f"{tmp_path}:{env['PATH']}"}


PRINT_ARGS = 'printf "%s\\n" "$@"\n'


def test_k8s_entrypoint_derives_the_three_flags_from_the_pod(tmp_path):
    env = _fake_commands(tmp_path, jaxtrain=PRINT_ARGS) | {
        "JOB_COMPLETION_INDEX": "3", "NUM_PROCESSES": "8", "COORDINATOR_HOST": "jaxtrain-0.jaxtrain"}
    result = subprocess.run([K8S / "entrypoint.sh", *USER_ARGS], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == ["train", *USER_ARGS, "--coordinator", "jaxtrain-0.jaxtrain:12355",
                                          "--num-processes", "8", "--process-id", "3"]


POD = {"JOB_COMPLETION_INDEX": "3", "NUM_PROCESSES": "8", "COORDINATOR_HOST": "jaxtrain-0.jaxtrain"}
MISSING_PYTHON = "#!/no/such/venv/bin/python\nprint('unreachable')\n"  # a virtual environment copied from elsewhere


def _one_line_exit_2(result, prefix: str, message: str) -> None:
    """A user mistake: one line on stderr, exit status 2, nothing run."""
    assert (result.returncode, result.stdout) == (2, ""), (result.returncode, result.stdout, result.stderr)
    assert result.stderr.startswith(prefix) and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


# Exit 2 is the manifest's FailJob code: bash's own 1 (`${VAR:?}`) and 127 (command not found) were retried
# up to backoffLimit although every retry fails the same way.
@pytest.mark.parametrize("pod, jaxtrain, message", [
    ({"JOB_COMPLETION_INDEX": None}, PRINT_ARGS, "JOB_COMPLETION_INDEX: not set: run this in a pod of an Indexed Job"),
    ({"NUM_PROCESSES": None}, PRINT_ARGS, "NUM_PROCESSES: not set: the manifest sets it"),
    ({"COORDINATOR_HOST": ""}, PRINT_ARGS, "COORDINATOR_HOST: not set: the manifest sets it"),
    ({"NUM_PROCESSES": "eight"}, PRINT_ARGS, "NUM_PROCESSES='eight' is not a positive integer"),
    ({"NUM_PROCESSES": "0"}, PRINT_ARGS, "NUM_PROCESSES='0' is not a positive integer"),
    ({"JOB_COMPLETION_INDEX": "8"}, PRINT_ARGS, "JOB_COMPLETION_INDEX='8' is not a process index 0..7 (NUM_PROCESSES=8)"),
    ({"COORDINATOR_PORT": "1 2"}, PRINT_ARGS, "COORDINATOR_PORT='1 2' is not a port 1..65535"),
    ({}, None, "cannot run 'jaxtrain' (not on PATH, or not executable): install jaxtrain in the image"),
    ({}, MISSING_PYTHON, "its interpreter '/no/such/venv/bin/python' does not exist"),
], ids=["no-index", "no-num-processes", "empty-host", "num-processes-eight", "num-processes-0", "index-out-of-range",
        "port-two-words", "no-jaxtrain", "jaxtrain-interpreter-gone"])
def test_k8s_entrypoint_mistakes_are_one_line_and_exit_2(tmp_path, pod, jaxtrain, message):
    env = _fake_commands(tmp_path, **({"jaxtrain": jaxtrain} if jaxtrain else {}))
    env["PATH"] = f"{tmp_path}:/usr/bin:/bin"  # no other jaxtrain (the test environment's own) to find
    env |= {k: v for k, v in (POD | pod).items() if v is not None}
    result = subprocess.run([K8S / "entrypoint.sh", "tiny"], env=env, capture_output=True, text=True)
    _one_line_exit_2(result, "entrypoint.sh: ", message)


@pytest.mark.parametrize("status", [1, 2, 143])
def test_k8s_entrypoint_passes_jaxtrain_exit_status_through(tmp_path, status):
    """143 (preempted, checkpoint committed) must reach the podFailurePolicy as it is, and so must every other."""
    env = _fake_commands(tmp_path, jaxtrain=f"echo ran >&2; exit {status}\n") | POD
    result = subprocess.run([K8S / "entrypoint.sh", "tiny"], env=env, capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (status, "ran\n")


def test_k8s_manifest_parts_agree():
    service, job = yaml.safe_load_all((K8S / "train.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == n == int(env["NUM_PROCESSES"]) == 8
    # pod 0 is JOB-0.SERVICE: the service is headless, selects the Job's pods, and is the pods' subdomain
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["COORDINATOR_HOST"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["COORDINATOR_PORT"] == str(service["spec"]["ports"][0]["port"]) == str(container["ports"][0]["containerPort"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # the command is the repository's script, relative to where the image holds the repository
    assert container["command"] == ["scripts/k8s/entrypoint.sh"] and (REPO / container["command"][0]).stat().st_mode & 0o111
    assert container["workingDir"].startswith("/")
    # preemption: exit 143 (checkpoint committed) and evictions restart the pod without using up retries
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "jaxtrain", "operator": "In", "values": [143]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    # exit 2, the entrypoint's and jaxtrain's code for a user mistake, fails the Job at once: a retry cannot help
    assert {"action": "FailJob", "onExitCodes": {"containerName": "jaxtrain", "operator": "In", "values": [2]}} in rules
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 120
    # the run directory is on the volume every pod mounts
    run_dir = container["args"][container["args"].index("--run-dir") + 1]
    mount = next(m for m in container["volumeMounts"] if run_dir.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "persistentVolumeClaim" in volume


def test_slurm_script_derives_the_three_flags_from_srun(tmp_path):
    # srun starts the command once per task with SLURM_PROCID and SLURM_NTASKS; this one plays task 5 of 8
    srun = 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NTASKS=8 SLURM_PROCID=5 exec "$@"\n'
    # a long host list: a script that cuts it with `| head` under pipefail dies of SIGPIPE here
    hosts = 'printf "gpu-node-017\\n"; for i in $(seq 18 20000); do echo "gpu-node-$i"; done\n'
    env = _fake_commands(tmp_path, jaxtrain=PRINT_ARGS, srun=srun, scontrol=hosts)
    env |= {"SLURM_JOB_NODELIST": "gpu-node-[017-024]"}
    result = subprocess.run(["bash", REPO / "scripts" / "slurm" / "train.sbatch", *USER_ARGS], env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == ["train", *USER_ARGS, "--coordinator", "gpu-node-017:12355",
                                          "--num-processes", "8", "--process-id", "5"]


def test_slurm_script_runs_the_jaxtrain_it_is_given_or_says_it_has_none(tmp_path):
    srun = 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NTASKS=2 SLURM_PROCID=1 exec "$@"\n'
    env = _fake_commands(tmp_path, srun=srun, scontrol='echo node-1\n', venv_jaxtrain='echo "from the venv: $1"\n')
    env |= {"SLURM_JOB_NODELIST": "node-1", "PATH": f"{tmp_path}:/usr/bin:/bin"}  # no jaxtrain on PATH
    sbatch = ["bash", REPO / "scripts" / "slurm" / "train.sbatch", "tiny"]
    given = subprocess.run(sbatch, env=env | {"JAXTRAIN": str(tmp_path / "venv_jaxtrain")}, capture_output=True, text=True, check=True)
    assert given.stdout == "from the venv: train\n"
    missing = subprocess.run(sbatch, env=env, capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == ("train.sbatch: cannot run 'jaxtrain' (not on PATH, or not executable); activate the environment "
                              "jaxtrain is installed in before sbatch, or set JAXTRAIN=/path/to/bin/jaxtrain\n")


SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
SRUN = 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NTASKS=2 SLURM_PROCID=1 exec "$@"\n'


@pytest.mark.parametrize("job, fakes, message", [
    # `bash train.sbatch` outside a job: was set -u's raw "SLURM_JOB_NODELIST: unbound variable", exit 1
    ({"SLURM_JOB_NODELIST": None}, {}, "SLURM_JOB_NODELIST is not set: this script runs inside a SLURM job; submit it with sbatch"),
    ({}, {"scontrol": None}, "'scontrol' is not on PATH: run this script on a SLURM cluster"),
    ({}, {"srun": None}, "'srun' is not on PATH: run this script on a SLURM cluster"),
    ({}, {"scontrol": "echo 'scontrol: error: bad list' >&2; exit 1\n"}, "scontrol show hostnames 'node-[1-2]' failed (see above)"),
    ({}, {"scontrol": "exit 0\n"}, "scontrol show hostnames 'node-[1-2]' gave no host"),
    ({"COORDINATOR_PORT": "12 355"}, {}, "COORDINATOR_PORT='12 355' is not a port 1..65535"),
    ({"COORDINATOR_PORT": "70000"}, {}, "COORDINATOR_PORT='70000' is not a port 1..65535"),
    ({}, {"jaxtrain": MISSING_PYTHON}, "its interpreter '/no/such/venv/bin/python' does not exist"),
    # in each task: srun's variables, and a jaxtrain the node itself can run (not only the batch node)
    ({}, {"srun": 'while [[ "$1" == --* ]]; do shift; done\nunset SLURM_NTASKS SLURM_PROCID\nexec "$@"\n'},
     "srun set SLURM_NTASKS='' SLURM_PROCID='', expected integers"),
    ({}, {"srun": 'while [[ "$1" == --* ]]; do shift; done\nPATH=/usr/bin:/bin SLURM_NTASKS=2 SLURM_PROCID=1 exec "$@"\n'},
     "cannot run 'jaxtrain' on "),
], ids=["outside-slurm", "no-scontrol", "no-srun", "scontrol-fails", "scontrol-no-hosts", "port-two-words", "port-70000",
        "jaxtrain-interpreter-gone", "task-without-srun-variables", "task-node-without-jaxtrain"])
def test_slurm_script_mistakes_are_one_line_and_exit_2(tmp_path, job, fakes, message):
    fakes = {"jaxtrain": PRINT_ARGS, "srun": SRUN, "scontrol": "echo node-1; echo node-2\n"} | fakes
    env = _fake_commands(tmp_path, **{name: body for name, body in fakes.items() if body is not None})
    env |= {"PATH": f"{tmp_path}:/usr/bin:/bin"}  # only the fakes: no real SLURM or jaxtrain of the test machine
    env |= {k: v for k, v in ({"SLURM_JOB_NODELIST": "node-[1-2]"} | job).items() if v is not None}
    result = subprocess.run(["bash", SBATCH, "tiny"], env=env, capture_output=True, text=True)
    result.stderr = result.stderr.removeprefix("scontrol: error: bad list\n")  # a failing scontrol's own reason comes first
    _one_line_exit_2(result, "train.sbatch: ", message)


def test_slurm_script_passes_any_characters_through(tmp_path):
    """JAXTRAIN and the arguments reach each task as they are: none is pasted into the task's command text (a '"'
    in JAXTRAIN broke its quoting there)."""
    odd = tmp_path / 'venv "$HOME" x'
    odd.mkdir()
    _fake_commands(odd, jaxtrain=PRINT_ARGS)
    env = _fake_commands(tmp_path, srun=SRUN, scontrol="echo node-1\n") | {"JAXTRAIN": str(odd / "jaxtrain"),
                                                                         "SLURM_JOB_NODELIST": "node-1"}
    args = ["tiny", 'a "b" $c', "d; e"]
    result = subprocess.run(["bash", SBATCH, *args], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == ["train", *args, "--coordinator", "node-1:12355", "--num-processes", "2", "--process-id", "1"]


def test_local_launcher_reports_the_failed_process_not_the_ones_it_stopped(tmp_path):
    """Process 1 fails on its config (2) while process 0 waits in a collective; the launcher stops process 0 (143, which
    means "preempted, resume" to the cluster templates) and must report the 2."""
    env = _fake_commands(tmp_path, job='[ "${@: -1}" = 1 ] && { sleep 0.3; exit 2; }\nsleep 30 &\ntrap "kill $!; exit 143" TERM\nwait\n')
    launch = [sys.executable, REPO / "scripts" / "launch_local.py"]
    result = subprocess.run([*launch, "--num-processes", "2", "--", "job"], env=env, capture_output=True, text=True, timeout=20, check=False)
    assert result.returncode == 2
    for args, message in ((["--num-processes", "0", "--", "job"], "--num-processes 0: give at least 1"),
                          (["--num-processes", "2", "--devices", "0", "--", "job"], "--devices 0: give at least 1"),
                          (["--num-processes", "2", "--port", "70000", "--", "job"], "--port 70000: give a TCP port in 1..65535"),
                          (["--num-processes", "2", "--", "no-such-command"], "command 'no-such-command' not found (not on PATH, or not executable)")):
        refused = subprocess.run([*launch, *args], env=env, capture_output=True, text=True, timeout=20, check=False)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr == f"launch_local.py: error: {message} (see 'launch_local.py --help')\n", refused.stderr
    # argparse's own errors too: one line (with its usage before it, they were three)
    refused = subprocess.run([*launch, "--num-processes", "x", "--", "job"], env=env, capture_output=True, text=True, timeout=20,
                             check=False)
    assert refused.returncode == 2 and refused.stderr == ("launch_local.py: error: argument --num-processes: invalid int value: 'x' "
                                                          "(see 'launch_local.py --help')\n"), refused.stderr


COUNT_SIGINTS = """import os, signal, sys, time
out = f"{sys.argv[1]}.{sys.argv[-1]}"  # the launcher adds --process-id I last
count = 0

def on_sigint(signum, frame):
    global count
    count += 1

signal.signal(signal.SIGINT, on_sigint)
open(f"{out}.ready", "w").close()
end = time.time() + 20
while not count and time.time() < end:
    time.sleep(0.01)
time.sleep(0.5)  # time for a second one to arrive
open(out, "w").write(f"{count} {os.getpgrp()}")
sys.exit(130)
"""


def test_local_launcher_forwards_a_ctrl_c_once_and_exits_130(tmp_path):
    """A Ctrl-C in a terminal signals the launcher's whole process group: each process must get one SIGINT (a second
    one, the launcher's copy, would abort the checkpoint the first asks for), so they are not in that group (two
    SIGINTs close together may arrive as one, so the count alone would not show it); the launcher exits 130 as they
    do, with nothing of its own on stderr."""
    (tmp_path / "count_sigints.py").write_text(COUNT_SIGINTS)
    env = _fake_commands(tmp_path, job=f'exec "{sys.executable}" "{tmp_path}/count_sigints.py" "$@"\n')
    out = tmp_path / "sigints"
    launcher = subprocess.Popen([sys.executable, REPO / "scripts" / "launch_local.py", "--num-processes", "2", "--", "job", str(out)],
                                env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,  # a shell's job: its own group
                                # SIGINT as a terminal leaves it, even where this test process ignores it (pytest-xdist's workers)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    end = time.time() + 20
    while not all((tmp_path / f"sigints.{i}.ready").exists() for i in range(2)) and time.time() < end:
        time.sleep(0.01)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, stderr = launcher.communicate(timeout=20)
    assert launcher.returncode == 130 and stderr == ""
    counts, groups = zip(*((tmp_path / f"sigints.{i}").read_text().split() for i in range(2)))
    assert counts == ("1", "1") and str(launcher.pid) not in groups  # the launcher leads its group: pgid == pid
