"""DeviceCounter tells device tensors from host ones by provenance and counts what would wait for
the device, what it launches and what it allocates."""

import torch
from helpers import dispatch_count as dc


def test_host_reads_of_device_values_are_syncs_and_host_work_is_not():
    with dc.DeviceCounter() as c:
        dev = c.mark(torch.arange(10))
        host = torch.arange(10)
        (
            int(host[3]),
            host.tolist(),
            bool(host.any()),
            host[host > 2],
            torch.unique(host),
        )  # host: free
        x = dev * 2
        int(x[1])  # item
        x.tolist()  # tolist
        x[x > 4]  # boolean mask
        torch.unique(x)  # unique
        x.nonzero()  # nonzero
        y = x.cpu()  # cpu: y is host from now on
        int(y[0])  # free
        torch.repeat_interleave(x[:3], x[:3], output_size=6)  # sized by the host: free
    kinds = [k for k, _ in c.syncs]
    assert kinds == ["item", "tolist", "boolean mask", "unique", "nonzero", "cpu"], kinds
    assert {site for _, site in c.syncs} == {"?"}  # asked by no runtime module


def test_moves_factories_copies_and_allocations():
    with dc.DeviceCounter() as c:
        dev = c.mark(torch.zeros(4))
        h = torch.tensor([1.0, 2.0])
        d = h.to(dev.device, non_blocking=True)  # a move: a device tensor (h stays host)
        z = torch.zeros(8, device="cpu")  # made on the device
        float(h[0])  # free
        float(d[0]), float(z[0])  # two syncs
        out = torch.empty(2)
        out.copy_(d, non_blocking=True)  # asynchronous copy to the host
        out.copy_(d)  # blocking: a sync
        dev.add_(1)  # in place: a launch, no allocation
    assert c.h2d == 1 and c.d2h == 1 and len(c.syncs) == 3
    assert c.is_device(d) and c.is_device(z) and not c.is_device(h) and not c.is_device(out)
    assert 32 in c.allocs and c.launches >= 2


def test_quiet_regions_and_counted_calls():
    import types

    calls = []
    mod = types.SimpleNamespace(kernel=lambda t: calls.append(int(t.sum())))
    with dc.count_calls(mod, "kernel"), dc.DeviceCounter() as c:
        dev = c.mark(torch.ones(3))
        mod.kernel(dev)  # one launch; its insides are not counted
        with dc.quiet():
            int(dev[0])
    assert calls == [3] and c.calls == {"kernel": 1} and c.syncs == [] and c.launches == 1
