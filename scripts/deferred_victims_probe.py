"""Probe (issue 27, helper tidy): the ARC/S3-FIFO programs of tests/scheduler/test_deferred_stores.py
with the batched settle and with a call-by-call settle (each recorded call through the general path,
in call order). Run: PYTHONPATH=$PWD python3 scripts/deferred_victims_probe.py"""

import asyncio
import sys

sys.path.insert(0, "tests/scheduler")
sys.path.insert(0, "tests")
import test_deferred_stores as t

import kvmgr.scheduler.settle as d

orig = d.settle


def settle_one_by_one(deferred, stores):
    if deferred.fan is None:
        return []
    fan, ends, gpu_ids, keys = deferred.take()
    return d._one_by_one(stores, fan, ends, gpu_ids, keys)


async def main():
    for name, fn in (("batched settle", orig), ("call-by-call settle", settle_one_by_one)):
        d.settle = fn
        for mod in list(sys.modules.values()):
            if getattr(mod, "settle", None) is orig and mod is not d:
                mod.settle = fn
        for policy, program in t._DIVERGING.items():
            a = await t._survivors(policy, program, recorded=True)
            b = await t._survivors(policy, program, recorded=False)
            print(name, policy, "same" if a == b else "differ")


asyncio.run(main())
