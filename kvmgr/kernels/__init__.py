"""kvmgr's GPU kernels, one folder per kernel family; importing this package imports none.

Families and shared modules (dependencies one-way: a family uses ``launch``, never another
family):
    mla/            the grouped MLA cache insert (``kernel``, ``checks``, ``reference``, ``host``,
                    ``bound``, ``api``, ``hook``)
    c128/           the DeepSeek-V4 c128 compressor (``layout``, ``gate``, ``reference``,
                    ``kernel``, ``host``, ``bounds``, ``api``, ``hook``)
    copy_pages      the descriptor copy kernel of the transfer engines
    copy_blocks     its paged variant: block runs, addresses computed on the device
    launch          ``DirectLauncher``: compiled Triton kernels launched past ``JITFunction.run``
    packed_launch   packed-argument launches through ``cuLaunchKernel`` (``DirectLauncher.bind``)
"""
