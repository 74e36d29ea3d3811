import mmap, time, sys
size = 1536 << 20
def once():
    m = mmap.mmap(-1, size + (2 << 20))
    m.madvise(mmap.MADV_HUGEPAGE)
    t = time.perf_counter()
    for off in range(0, size, 4096):
        m[off] = 1
    dt = time.perf_counter() - t
    m.close()
    return dt
for pause in [0, 0, 0, 15, 0, 15]:
    time.sleep(pause)
    print(f"after {pause:2d} s idle: touched 1.5 GiB of huge pages in {once():.2f} s", flush=True)
