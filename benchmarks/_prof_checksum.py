import torch, time, statistics, sys
from distnb.worker import checksum as ck
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
t = torch.randn(16 << 20, device=dev)  # 64 MiB
nb = t.numel() * 4
def sync():
    if dev != "cpu": torch.cuda.synchronize()
def gbps(f, reps=7):
    f(); sync(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); sync(); ts.append(time.perf_counter() - t0)
    return round(nb / statistics.median(ts) / 1e9, 2)
print("threads", torch.get_num_threads(), dev)
print("sum", gbps(lambda: t.sum()), "norm", gbps(lambda: torch.linalg.vector_norm(t)), "aminmax", gbps(lambda: torch.aminmax(t)),
      "stats", gbps(lambda: ck._stats(t)), "fingerprint", gbps(lambda: ck.fingerprint(t)), "checksum", gbps(lambda: ck.checksum(t)))
X = t.view(torch.int32).view(-1, ck.WIDTH)
cols = ck._columns(t.device)
for B in [16, 32, 64, 128, 256, 4096]:
    buf = torch.empty(B, ck.WIDTH, dtype=torch.float64, device=dev); y = torch.empty(X.shape[0], 3, dtype=torch.float64, device=dev)
    def copy_only():
        for r in range(0, X.shape[0], B): buf.copy_(X[r:r+B])
    def both():
        for r in range(0, X.shape[0], B):
            buf.copy_(X[r:r+B]); torch.mm(buf, cols, out=y[r:r+B])
    print("B", B, "copy", gbps(copy_only), "copy+mm", gbps(both))
