"""What hvd-train doctor makes of one host's probe (hvd_train/tools/doctor_probes.py): its report rows, each a
result and a fix, from the facts the host sent and the facts of the host the doctor runs on (the command, its ssh
and its table: hvd_train/tools/doctor.py)."""


def jpeg_engines(capability):
    """Whether a GPU of this compute capability has hardware JPEG decoders (nvJPEG's NVJPEG_BACKEND_HARDWARE, which
    torchvision's decode_jpeg on CUDA tries first and leaves for the CUDA cores where nvjpegCreateEx says
    NVJPEG_STATUS_ARCH_MISMATCH); None for an architecture newer than this list.

    The list is NVIDIA's (nvJPEG documentation, "Hardware Acceleration": Ampere A100 and A30, Hopper, Ada,
    Blackwell, Jetson Thor): sm_80 is A100/A30 alone among Ampere (sm_86 and sm_87, A10, A40, RTX 30, Jetson Orin,
    have none), sm_89 Ada (L4, L40, L40S), sm_90 Hopper (H100, H200, GH200), sm_100 to sm_121 Blackwell (B200,
    GB200, B300, Jetson Thor, RTX PRO 6000). Volta and Turing (V100, T4) and older have none."""
    major, minor = capability
    if major > 12:
        return None
    return (major, minor) in ((8, 0), (8, 9)) or major >= 9


def nvjpeg_check(gpu_name, capability, driver_capabilities, video_library):
    """The nvjpeg row, (status, detail, fix), from the GPU's name and compute capability, the container's
    NVIDIA_DRIVER_CAPABILITIES (None where unset: not started by the NVIDIA Container Toolkit, or no container) and
    whether the driver's video decode library (libnvcuvid.so.1) loads.

    nvJPEG's hardware backend needs the driver's `video` capability (NVIDIA's answers in CUDALibrarySamples#132 and
    nvImageCodec#26): without it the backend is refused and decode_jpeg silently decodes on the CUDA cores. For that
    capability the NVIDIA Container Toolkit mounts the driver's video libraries (libnvcuvid, libnvidia-encode,
    libnvidia-opticalflow, libvdpau_nvidia); libnvcuvid.so.1 loading is taken as the sign that they are there, which
    is what counts. The variable only explains why they are not (and may differ from what the toolkit read:
    docker run --gpus 'all,"capabilities=..."' appends a second one)."""
    sm = f"sm_{capability[0]}{capability[1]}"
    engines = jpeg_engines(tuple(capability))
    fallback = "--data.decode gpu decodes on the CUDA cores"
    if engines is False:
        return "ok", f"no hardware decoder: the {gpu_name} ({sm}) has no hardware JPEG engine; {fallback}", ""
    if engines is None:
        return "ok", (f"hardware decoder unknown: the {gpu_name} ({sm}) is newer than the GPUs this check knows; the "
                      f"driver's video libraries are {'present' if video_library else 'missing'}"), ""
    if video_library:
        mig = (" if this MIG instance's profile has JPEG engines (nvidia-smi mig -lgip)"
               if "MIG" in gpu_name.split() else "")
        return "ok", f"hardware decoder available{mig} ({gpu_name}; driver video libraries present)", ""
    caps = None if driver_capabilities is None else {c.strip() for c in driver_capabilities.split(",")}
    if caps is not None and not caps & {"video", "all"}:
        return ("WARN", f"hardware decoder not available: this container lacks the driver's video capability "
                f"(NVIDIA_DRIVER_CAPABILITIES={driver_capabilities}); {fallback}",
                "run the image with --gpus all and NVIDIA_DRIVER_CAPABILITIES including video (docker/README.md)")
    if caps is not None:
        return ("WARN", f"hardware decoder not available: NVIDIA_DRIVER_CAPABILITIES={driver_capabilities} names "
                f"video, but the driver's libnvcuvid.so.1 does not load; {fallback}",
                "the host's driver lacks its video libraries (Debian/Ubuntu: libnvidia-decode-<driver branch>), or the "
                "container was not started through the NVIDIA Container Toolkit (docker run --gpus all)")
    return ("WARN", f"hardware decoder not available: the driver's libnvcuvid.so.1 does not load; {fallback}",
            "install the driver's video decode library (Debian/Ubuntu: libnvidia-decode-<driver branch>); in a "
            "container, give it the video driver capability (docker/README.md)")


def check_host(report, name, slots, facts, reference, args):
    versions = {k: facts[k] for k in ("python", "torch", "horovod", "hvd-train")}
    differ = [f"{k} {versions[k]} (here {reference[k]})" for k in versions if versions[k] != reference[k]]
    report.add(name, "versions", "FAIL" if differ else "ok",
               "; ".join(differ) if differ else ", ".join(f"{k} {v}" for k, v in versions.items()),
               "install the same versions on every host (scripts/install.sh from the same checkout, or one image)"
               if differ else "")
    build = facts["build"]
    if "error" in build:
        report.add(name, "horovod build", "FAIL", build["error"], "run scripts/install.sh on this host")
    else:
        has = ", ".join(k for k, v in build.items() if v) or "nothing"
        missing = "MPI" if not (args.gloo or build["MPI"]) else ("Gloo" if args.gloo and not build["Gloo"] else "")
        report.add(name, "horovod build", "FAIL" if missing else "ok", has + (f"; no {missing}" if missing else ""),
                   f"rebuild Horovod with {missing} (scripts/install.sh), or launch with "
                   f"{'--mpi' if missing == 'Gloo' else '--gloo'}" if missing else "")
        if facts["gpus"] and not build["NCCL"]:
            report.add(name, "nccl", "WARN", f"{facts['gpus']} GPU(s) but Horovod has no NCCL: gradients go "
                       "through host memory", "scripts/install.sh --gpu")
    if args.network_interface:
        addresses = facts["interfaces"].get(args.network_interface)
        report.add(name, "interface", "ok" if addresses else "FAIL",
                   f"{args.network_interface} {', '.join(addresses)}" if addresses else
                   f"no interface {args.network_interface} with an IPv4 address (it has "
                   f"{', '.join(sorted(facts['interfaces']))})",
                   "" if addresses else "name an interface every host has (--network-interface), e.g. the one "
                   "of the address the host names resolve to")
    resolved = facts["resolves_to"] or ""
    # Only matters between hosts: a job on one host talks over loopback anyway.
    loopback = resolved.startswith("127.") and args.multi_host
    report.add(name, "hostname", "WARN" if loopback or not resolved else "ok",
               f"{facts['hostname']} resolves to {resolved or 'nothing'}"
               + (" (loopback)" if resolved.startswith("127.") else ""),
               f"map {facts['hostname']} to this host's network address in /etc/hosts; until then pass "
               f"--network-interface to horovodrun (hvd-train's Horovod build then ignores the hostname; a stock "
               f"Horovod's Gloo aborts with 'connect [127.0.0.1]')" if loopback or not resolved else "")
    gpus = facts["gpus"]
    if gpus:
        status = "FAIL" if slots > gpus else ("WARN" if slots < gpus else "ok")
        report.add(name, "slots", status, f"{slots} slot(s), {gpus} GPU(s)",
                   {"FAIL": f"{name}:{gpus}: one rank per GPU (ranks would share a GPU)",
                    "WARN": f"{name}:{gpus} uses every GPU"}.get(status, ""))
        if facts.get("gpu_model"):
            report.add(name, "nvjpeg", *nvjpeg_check(*facts["gpu_model"], facts["driver_capabilities"],
                                                     facts["video_library"]))
    else:
        cpus = facts.get("cpus") or 0
        over = slots > cpus > 0
        report.add(name, "slots", "WARN" if over else "ok", f"{slots} slot(s), no GPU, {cpus} CPU core(s)",
                   f"{name}:{cpus} at most: more CPU ranks than cores share them, and every step waits for the "
                   f"slowest rank" if over else "")
    if not args.gloo:
        report.add(name, "mpirun", "ok" if facts["mpirun"] else "FAIL",
                   facts["mpirun"] or "not in the environment nor on PATH",
                   "" if facts["mpirun"] else "set up the environment on every host (scripts/install.sh installs an "
                   "MPI), or launch with horovodrun --gloo")
    skew = facts["skew"]
    report.add(name, "clock", "WARN" if abs(skew) > 2 else "ok", f"{skew:+.1f} s against this host",
               "run NTP/chrony on every host: logs and timelines are compared across hosts" if abs(skew) > 2 else "")
    free = facts["disk_free"] / 2**30
    bad = not facts["disk_writable"] or free < 1
    report.add(name, "disk", "FAIL" if bad else "ok",
               f"{free:.1f} GiB free in {facts['disk_path']}" + ("" if facts["disk_writable"] else ", not writable"),
               "free space, or give --output-dir a writable directory with room for checkpoints" if bad else "")
