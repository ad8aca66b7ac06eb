"""Counting host reads inside the device gathers of an engine run (tests of both plug-ins)."""

from __future__ import annotations


def count_gather_host_reads():
    """A context in which every DeviceGather.all_gather and handle wait runs under a HostReadCounter: the
    aten ops that would read the host on a GPU, inside the gathers only (the engine's own reads, the
    prepare's size read and the check are outside), summed into the yielded Counter."""
    import collections
    import contextlib

    from ciera_runtime import device_gather

    @contextlib.contextmanager
    def counting():
        total: collections.Counter = collections.Counter()
        gather, wait = device_gather.DeviceGather.all_gather, device_gather.DeviceGatherHandle.wait

        def counted(function):
            def run(*args, **kwargs):
                with device_gather.HostReadCounter() as counter:
                    result = function(*args, **kwargs)
                total.update(counter.counts)
                return result

            return run

        device_gather.DeviceGather.all_gather = counted(gather)
        device_gather.DeviceGatherHandle.wait = counted(wait)
        try:
            yield total
        finally:
            device_gather.DeviceGather.all_gather, device_gather.DeviceGatherHandle.wait = gather, wait

    return counting()
