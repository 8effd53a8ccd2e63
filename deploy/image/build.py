"""`make image`: build the CPU (or CUDA) image with podman or docker, report its size and build time,
then smoke-test it (deploy/image/smoke.py).

Where no base image can be pulled (only package registries are reachable on some machines), the
bases are made locally from Debian's packages: `debootstrap --variant=minbase bookworm` plus Python
3.11 in a venv, imported with `podman import` and cached. Where no OCI runtime works (crun cannot
`setrlimit` in some sandboxes), podman builds with `--isolation chroot`. The build host's CA bundle
goes in as a build secret, never into a layer. Standard library only: any python3 runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402  (deploy/image/smoke.py, beside this file)

LOCAL_BASE = "localhost/mha-encoder-base:bookworm-py311"
# What python:3.11-slim-bookworm has, near enough; no wget, so the Dockerfile's own step that installs
# it (for the manifests' liveness probe) runs here as it does on the public base.
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates"]
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CACHE = Path(os.environ.get("IMAGE_CACHE", "/var/tmp/mha-encoder-image"))
TORCH = "torch-2.13.0+cpu-"  # the CPU-only wheel the export stage prefers when one lies on this machine
TORCH_LINKS_PORT = 38917  # fixed, so the export stage's pip layer stays cached from one build to the next
PATH_IN_BASE = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def say(message: str) -> None:
    """A progress line on stdout, with the wall-clock time."""
    print(f"[image {time.strftime('%H:%M:%S')}] {message}", flush=True)


def fail(message: str) -> None:
    """One line on stderr, exit 1."""
    print(f"make image: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def run(cmd: list[str], check: bool = True, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output as text."""
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        fail(f"{' '.join(cmd[:4])} ... exited {result.returncode}: {(result.stderr or result.stdout).strip()[-600:]}")
    return result


# --- the engine --------------------------------------------------------------------------------


def find_engine(wanted: str | None) -> str:
    """podman if it is there, else docker with a daemon that answers (a docker client alone is not enough)."""
    candidates = [wanted] if wanted else ["podman", "docker"]
    reasons = []
    for name in candidates:
        if not shutil.which(name):
            reasons.append(f"{name} not on PATH")
            continue
        probe = run([name, "info", "--format", "{{.Host.OCIRuntime.Name}}" if name == "podman" else "{{.ServerVersion}}"],
                    check=False, timeout=60)
        if probe.returncode == 0:
            return name
        reasons.append(f"{name}: {(probe.stderr or probe.stdout).strip().splitlines()[-1:]}")
    if not wanted and install_packages(["podman"]):
        return "podman"
    fail("needs podman or docker (with a running daemon): " + "; ".join(reasons)
         + ". On Debian: apt-get install podman debootstrap")
    raise AssertionError


def install_packages(packages: list[str]) -> bool:
    """apt-get install the Debian packages when apt-get is there and we are root; False otherwise."""
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return False
    say(f"installing {' '.join(packages)} (Debian packages)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if run(["apt-get", "update", "-qq"], check=False, env=env).returncode != 0:
        return False
    return run(["apt-get", "install", "-y", "-qq", *packages], check=False, env=env).returncode == 0


def oci_runtime_works(engine: str, image: str) -> bool:
    """Whether a container can run here (podman run of a trivial command); False where crun/runc fail."""
    if engine != "podman":
        return True
    result = run([engine, "run", "--rm", "--network", "none", image, "true"], check=False, timeout=120)
    return result.returncode == 0


def image_exists(engine: str, image: str) -> bool:
    return run([engine, "image", "inspect", image], check=False).returncode == 0


@functools.cache
def try_pull(engine: str, image: str) -> bool:
    """Pull a public base image; False (quickly) where no registry is reachable."""
    say(f"pulling {image}")
    result = run([engine, "pull", "-q", image], check=False, timeout=900)
    if result.returncode != 0:
        say(f"cannot pull {image}: {(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    return result.returncode == 0


def image_size(engine: str, image: str) -> int:
    """Uncompressed size in bytes, as the engine reports it."""
    return int(run([engine, "image", "inspect", "--format", "{{.Size}}", image]).stdout.strip())


# --- a base made from Debian's packages --------------------------------------------------------


def make_local_base(engine: str, rebuild: bool) -> dict:
    """Debian bookworm (Python 3.11) minbase + a venv on the PATH, imported as LOCAL_BASE; cached."""
    if image_exists(engine, LOCAL_BASE) and not rebuild:
        say(f"local base {LOCAL_BASE} is cached ({image_size(engine, LOCAL_BASE) / 1e6:.0f} MB)")
        return {"image": LOCAL_BASE, "cached": True}
    if engine != "podman":
        fail("making a local base needs podman (podman import); install it or pass bases that can be pulled")
    if not shutil.which("debootstrap") and not install_packages(["debootstrap"]):
        fail("a local base needs the Debian package debootstrap: apt-get install debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = CACHE / "rootfs"
    remove_rootfs(rootfs)
    say(f"debootstrap --variant=minbase bookworm (+ {', '.join(BASE_PACKAGES)}) into {rootfs} (about a minute)")
    t0 = time.monotonic()
    result = run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(rootfs),
                  DEBIAN_MIRROR], check=False)
    if result.returncode != 0:
        fail(f"debootstrap failed: {result.stdout.strip()[-400:]} {result.stderr.strip()[-400:]}")
    # `python` and `pip` on the PATH, as in the python:3.11-slim images, and no PEP 668 refusal; login
    # shells too (KubeRay runs `/bin/bash -lc`, and Debian's /etc/profile sets PATH from scratch)
    run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"])
    (rootfs / "etc/profile.d/venv.sh").write_text('export PATH="/opt/venv/bin:$PATH"\n')
    # as Debian's own container images: apt keeps no package caches (80 MB after an apt-get update)
    (rootfs / "etc/apt/apt.conf.d/docker-clean").write_text(
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
        '/var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";\n')
    for junk in ["var/cache/apt/archives", "var/lib/apt/lists"]:
        for path in (rootfs / junk).glob("*"):
            if path.is_file():
                path.unlink()
    for path in (rootfs / "var/cache/apt").glob("*.bin"):
        path.unlink()
    (rootfs / "etc/resolv.conf").write_text("")  # the engine provides one at build and run time
    debootstrap_s = time.monotonic() - t0
    say(f"podman import -> {LOCAL_BASE}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--one-file-system", "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run([engine, "import", "--change", f"ENV PATH={PATH_IN_BASE}", "--change", "ENV LANG=C.UTF-8",
                               "--change", 'CMD ["python"]', "-", LOCAL_BASE], stdin=tar.stdout, capture_output=True, text=True)
    tar.stdout.close()
    if tar.wait() != 0 or imported.returncode != 0:
        fail(f"podman import failed: {imported.stderr.strip()[-400:]}")
    remove_rootfs(rootfs)
    total_s = time.monotonic() - t0
    size = image_size(engine, LOCAL_BASE)
    say(f"local base ready: {size / 1e6:.0f} MB in {total_s:.0f} s (debootstrap and venv {debootstrap_s:.0f} s)")
    return {"image": LOCAL_BASE, "cached": False, "seconds": round(total_s, 1), "size_bytes": size}


def remove_rootfs(rootfs: Path) -> None:
    """Delete a debootstrap tree, first unmounting what an interrupted debootstrap left mounted in it
    (its /proc, /sys): deleting through a mount would reach the host's files."""
    if not rootfs.exists():
        return
    prefix = str(rootfs.resolve()) + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        run(["umount", "-l", mount], check=False)
    if any(line.split()[4].startswith(prefix) for line in Path("/proc/self/mountinfo").read_text().splitlines()):
        fail(f"{rootfs} still has file systems mounted in it; unmount them, then delete it")
    shutil.rmtree(rootfs)


# --- what goes into the build ------------------------------------------------------------------


def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    """The ARG defaults the Dockerfile declares before its first FROM (the base images)."""
    args: dict[str, str] = {}
    for line in dockerfile.read_text().splitlines():
        line = line.strip()
        if line.upper().startswith("FROM "):
            break
        if m := re.match(r"ARG\s+(\w+)=(\S+)", line):
            args[m.group(1)] = m.group(2).strip("\"'")
    return args


def host_ca_bundle(explicit: str | None) -> str | None:
    """The CA bundle pip uses on this host (pip's `cert` setting, PIP_CERT, or the system bundle)."""
    if explicit:
        return explicit
    candidates = [os.environ.get("PIP_CERT"), pip_config("global.cert"), os.environ.get("SSL_CERT_FILE"),
                  "/etc/ssl/certs/ca-certificates.crt"]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def pip_config(key: str) -> str | None:
    """A value of pip's configuration on this host (the repository's venv, else this Python's pip)."""
    for python in [ROOT / ".venv/bin/python", Path(sys.executable)]:
        if python.is_file():
            got = run([str(python), "-m", "pip", "config", "get", key], check=False)
            if got.returncode == 0 and got.stdout.strip():
                return got.stdout.strip().strip("'\"")
    return None


def local_torch_wheel() -> Path | None:
    """A CPU-only torch 2.13.0 wheel in pip's find-links directories on this host, if there is one."""
    dirs = [d for d in re.split(r"[\s]+", os.environ.get("PIP_FIND_LINKS", "")) if d]
    dirs += (pip_config("global.find-links") or "").split()
    for d in dirs:
        d = d.removeprefix("file://")
        for wheel in sorted(Path(d).glob(f"{TORCH}cp311-*linux*x86_64.whl")) if Path(d).is_dir() else []:
            return wheel
    return None


@contextlib.contextmanager
def serve_links(wheel: Path):
    """A page of links to one wheel on 127.0.0.1 (pip --find-links) while the build runs."""
    links = CACHE / "torch-links"
    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    (links / wheel.name).symlink_to(wheel)
    handler = functools.partial(Quiet, directory=str(links))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_LINKS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # pip's requests are not news
        pass


# --- the build ---------------------------------------------------------------------------------


def build(engine: str, isolation: str | None, dockerfile: Path, tag: str, build_args: dict[str, str],
          cert: str | None, log: Path, host_network: bool) -> tuple[float, list[dict]]:
    """Build the image, the full log to `log` and a progress line per step to stdout; (seconds taken,
    the seconds each step began at)."""
    cmd = [engine, "build", "-f", str(dockerfile), "-t", tag]
    if engine == "podman":
        # the docker format keeps HEALTHCHECK (the OCI format has no field for it, podman drops it)
        cmd += ["--layers", "--format", "docker"] + ([f"--isolation={isolation}"] if isolation else [])
    if host_network:
        cmd += ["--network", "host"]
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    if cert:
        cmd += ["--secret", f"id=pipcert,src={cert}"]
    cmd.append(str(ROOT))
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}  # docker: secrets and RUN --mount need BuildKit
    say(f"building {tag}: {' '.join(cmd)}")
    say(f"full log: {log}")
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        assert proc.stdout
        tail: list[str] = []
        steps: list[dict] = []
        for line in proc.stdout:
            out.write(line)
            tail = (tail + [line.rstrip()])[-30:]
            step = re.match(r"(\[\d+/\d+\] )?STEP \d+/\d+|#\d+ \[", line)
            if step or "Successfully installed" in line:
                say(f"  {time.monotonic() - t0:5.0f} s  {line.strip()[:150]}")
            if step:
                steps.append({"at_s": round(time.monotonic() - t0, 1), "step": line.strip()[:160]})
        rc = proc.wait()
    if rc != 0:
        print("\n".join(tail), file=sys.stderr)
        fail(f"{engine} build exited {rc} (full log {log})")
    return time.monotonic() - t0, steps


def certificates(text: str) -> set[str]:
    return set(re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", text, re.S))


def secret_left_out(engine: str, tag: str, cert: str | None) -> dict:
    """Check that the CA bundle handed in as a build secret is nowhere in the image: no
    /run/secrets/pipcert, and none of the certificates it has beyond the image's own bundle."""
    if engine != "podman" or not cert:
        return {"checked": False}
    root = Path(run([engine, "image", "mount", tag]).stdout.strip())
    try:
        own = root / "etc/ssl/certs/ca-certificates.crt"
        extra = certificates(Path(cert).read_text()) - (certificates(own.read_text()) if own.is_file() else set())
        needles = [c.splitlines()[1] for c in extra]  # a certificate's first line of base64 is unique enough
        found = [str(p) for p in [root / "run/secrets/pipcert"] if p.exists()]
        if needles:
            grep = run(["grep", "-rlF", *[a for n in needles for a in ("-e", n)], str(root)], check=False)
            found += [line.removeprefix(str(root)) for line in grep.stdout.splitlines()]
        return {"checked": True, "host_only_certificates": len(needles), "found_in_image": found}
    finally:
        run([engine, "image", "unmount", tag], check=False)


def main(argv: list[str] | None = None) -> int:
    """Build, measure and smoke-test the image; writes RESULTS/report-TAG.json."""
    p = argparse.ArgumentParser(prog="make image", description=__doc__.split("\n\n")[0])
    p.add_argument("--dockerfile", default="deploy/Dockerfile")
    p.add_argument("--tag", default=None, help="default localhost/mha-encoder:0.1.0-cpu (or -cuda)")
    p.add_argument("--engine", choices=["podman", "docker"], default=os.environ.get("IMAGE_ENGINE") or None)
    p.add_argument("--local-base", action="store_true", default=os.environ.get("LOCAL_BASE") == "1",
                   help="build on a base made from Debian's packages without trying to pull (LOCAL_BASE=1)")
    p.add_argument("--rebuild-base", action="store_true", help="make the local base again even when cached")
    p.add_argument("--export-base", help="EXPORT_BASE build arg (default: the Dockerfile's, else a local base)")
    p.add_argument("--serve-base", help="SERVE_BASE build arg (default: the Dockerfile's, else a local base)")
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="more build args")
    p.add_argument("--cert", help="CA bundle handed to pip in the build (default: pip's cert setting here)")
    p.add_argument("--no-local-torch", action="store_true",
                   help="do not hand a CPU torch wheel found on this host to the export stage")
    p.add_argument("--isolation", help="podman build --isolation (default: chroot where containers cannot run)")
    p.add_argument("--prune", action="store_true",
                   help="podman/docker image prune after the build: frees superseded layers, and the export stage's cache")
    p.add_argument("--no-smoke", action="store_true", help="build and measure only")
    p.add_argument("--smoke-only", action="store_true", help="smoke-test an image built before")
    p.add_argument("--results", default="results/image")
    a = p.parse_args(argv)

    dockerfile = (ROOT / a.dockerfile).resolve()
    tag = a.tag or f"localhost/mha-encoder:0.1.0-{'cuda' if dockerfile.name.endswith('.cuda') else 'cpu'}"
    results = (ROOT / a.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    engine = find_engine(a.engine)
    say(f"engine: {engine} ({run([engine, '--version']).stdout.strip()})")
    report: dict = {"date": datetime.date.today().isoformat(), "engine": engine, "dockerfile": a.dockerfile, "tag": tag,
                    "host": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    report_path = results / f"report-{tag.rsplit(':', 1)[-1]}.json"

    if not a.smoke_only:
        defaults = dockerfile_args(dockerfile)
        bases = {"EXPORT_BASE": a.export_base, "SERVE_BASE": a.serve_base}
        local = None
        for key, given in bases.items():
            wanted = given or defaults.get(key)
            if wanted and (image_exists(engine, wanted) or (not a.local_base and not given and try_pull(engine, wanted))):
                bases[key] = wanted
            elif given:
                if not try_pull(engine, given):
                    fail(f"{key}={given} is neither here nor pullable")
            else:
                local = local or make_local_base(engine, a.rebuild_base)
                bases[key] = local["image"]
        report["bases"] = {k: {"image": v, "size_bytes": image_size(engine, v)} for k, v in bases.items()}
        if local:
            report["local_base"] = local
        build_args = dict(bases)
        build_args.update(kv.split("=", 1) for kv in a.build_arg)
        isolation = a.isolation
        if engine == "podman" and not isolation and not os.environ.get("BUILDAH_ISOLATION"):
            if not oci_runtime_works(engine, bases["EXPORT_BASE"]):
                say("containers cannot run here (OCI runtime fails): building with --isolation chroot")
                isolation = "chroot"
        cert = host_ca_bundle(a.cert)
        say("CA bundle for pip in the build (a build secret, in no layer): "
            + (cert or "none found, pip uses the image's own"))
        wheel = None if a.no_local_torch or "TORCH_FIND_LINKS" in build_args or "TORCH_INDEX_URL" in build_args \
            else local_torch_wheel()
        with serve_links(wheel) if wheel else contextlib.nullcontext() as links:
            if links:
                say(f"export stage installs the CPU-only torch from this host: {wheel.name} via {links}")
                build_args["TORCH_FIND_LINKS"] = links
            # the loopback link page is reachable from the build only on the host's network
            host_network = bool(links) and isolation != "chroot"
            seconds, steps = build(engine, isolation, dockerfile, tag, build_args, cert,
                                   results / f"build-{tag.rsplit(':', 1)[-1]}.log", host_network)
        report["build"] = {"seconds": round(seconds, 1), "isolation": isolation or "oci",
                           "build_args": dict(build_args), "steps": steps}
        size = image_size(engine, tag)
        report["size_bytes"] = size
        say(f"built {tag}: {size / 1e9:.2f} GB ({size} bytes, {engine} image inspect --format {{{{.Size}}}}) "
            f"in {seconds / 60:.1f} min")
        report["layers"] = layers(engine, tag)
        if a.prune:
            run([engine, "image", "prune", "-f"], check=False)
        say(f"{engine} storage now: {storage(engine)} (superseded layers stay as build cache; --prune frees them)")
        inspected = json.loads(run([engine, "image", "inspect", tag]).stdout)[0]
        config = inspected.get("Config") or {}
        config["Healthcheck"] = config.get("Healthcheck") or inspected.get("Healthcheck")  # podman: beside Config
        report["config"] = {k: config.get(k) for k in ("User", "WorkingDir", "Cmd", "Healthcheck", "ExposedPorts")}
        if not config.get("Healthcheck"):
            say("WARNING: the image has no HEALTHCHECK (an OCI-format image cannot carry one)")
        leak = secret_left_out(engine, tag, cert)
        report["ca_bundle_secret"] = leak
        if leak.get("found_in_image"):
            fail(f"the CA bundle handed in as a build secret is in the image: {leak['found_in_image'][:5]}")
        if leak.get("checked"):
            say(f"the build secret is in no layer: none of the {leak['host_only_certificates']} certificates "
                "only the host's bundle has is in the image")
        report_path.write_text(json.dumps(report, indent=2) + "\n")

    if a.no_smoke:
        return 0
    if a.smoke_only and report_path.is_file():
        report = {**json.loads(report_path.read_text()), "engine": engine}
    if not image_exists(engine, tag):
        fail(f"no image {tag} to smoke-test: make image first")
    if engine == "podman" and not shutil.which("runc"):  # containers run here with runc (smoke.run_prefix)
        install_packages(["runc"])
    outcome = smoke.smoke(engine, tag, results / f"smoke-{tag.rsplit(':', 1)[-1]}.log", say)
    report["smoke"] = outcome
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    say(f"report: {report_path}")
    return 0 if outcome["passed"] else 1


def storage(engine: str) -> str:
    """What the engine's storage takes on disk (du of podman's graph root; `system df` counts shared
    layers once per image)."""
    if engine != "podman":
        return "see docker system df"
    root = run([engine, "info", "--format", "{{.Store.GraphRoot}}"], check=False).stdout.strip()
    du = run(["du", "-sh", root], check=False).stdout.split()
    return f"{du[0]} in {root}" if du else "unknown"


def layers(engine: str, tag: str) -> list[dict]:
    """The image's layers, newest first: size and the instruction that made each."""
    out = run([engine, "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", tag], check=False).stdout
    rows = []
    for line in out.splitlines():
        size, _, created_by = line.partition("\t")
        rows.append({"size": size.strip(), "created_by": re.sub(r"\s+", " ", created_by)[:200]})
    return rows


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        fail("interrupted")
