"""The scripts hvd-train doctor runs on every host with that host's Python, over ssh: sent as text, so that nothing
has to be installed there but Python itself."""

# Runs on every host (stdin of `python -`): one JSON line of facts, nothing that needs Horovod to be initialised.
PROBE = r"""
import json, os, platform, shutil, socket, sys, time
from importlib import metadata
facts = {"python": platform.python_version(), "time": time.time(), "hostname": socket.gethostname()}
for dist in ("torch", "horovod", "hvd-train"):
    try:
        facts[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        facts[dist] = None
try:
    facts["resolves_to"] = socket.gethostbyname(socket.gethostname())
except OSError:
    facts["resolves_to"] = None
import psutil
facts["interfaces"] = {name: [a.address for a in addrs if a.family == socket.AF_INET]
                       for name, addrs in psutil.net_if_addrs().items()}
# A link's rate in Mb/s as its driver reports it; None for a virtual interface (veth, a bridge, loopback: no device
# behind it, and a made-up speed) or one whose rate is unknown.
def nominal_mbit(name):
    if not os.path.exists(f"/sys/class/net/{name}/device"):
        return None
    try:
        with open(f"/sys/class/net/{name}/speed") as f:
            speed = int(f.read())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None
facts["link_mbit"] = {name: nominal_mbit(name) for name in facts["interfaces"]}
ib = "/sys/class/infiniband"
facts["infiniband"] = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
facts["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
try:
    import horovod.torch as hvd
    facts["build"] = {"MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(), "NCCL": hvd.nccl_built() > 0}
except Exception as e:
    facts["build"] = {"error": f"{type(e).__name__}: {e}"}
import torch
facts["gpus"] = torch.cuda.device_count()
# For the nvjpeg row: the first GPU's model, whether the driver's video decode library loads (what a container's
# `video` driver capability mounts; nvJPEG's hardware backend needs it), and the capabilities the container asked for.
facts["gpu_model"] = None
if facts["gpus"]:
    try:
        facts["gpu_model"] = [torch.cuda.get_device_name(0), list(torch.cuda.get_device_capability(0))]
    except Exception:
        pass
import ctypes
try:
    ctypes.CDLL("libnvcuvid.so.1")
    facts["video_library"] = True
except OSError:
    facts["video_library"] = False
facts["driver_capabilities"] = os.environ.get("NVIDIA_DRIVER_CAPABILITIES")
facts["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
# The environment's own mpirun first (an MPI setup installed from PyPI), as horovodrun runs it, then PATH's.
facts["mpirun"] = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
path = os.path.abspath(sys.argv[1])
while not os.path.exists(path):
    path = os.path.dirname(path)
facts["disk_path"], facts["disk_free"] = path, shutil.disk_usage(path).free
facts["disk_writable"] = os.access(path, os.W_OK)
print(json.dumps(facts))
"""

# Listens on one address until stdin closes; prints its port first.
LISTEN = r"""
import socket, sys, threading
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
threading.Thread(target=lambda: [s.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
sys.stdin.read()
"""

# Connects to every (name, address, port) given as JSON; prints which failed and why.
CONNECT = r"""
import json, socket, sys
failed = {}
for name, address, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((address, port), timeout=10).close()
    except OSError as e:
        failed[name] = f"{address}:{port}: {e.strerror or e}"
print(json.dumps(failed))
"""
