"""kvmgr's GPU kernels, one folder per kernel family; importing this package imports none.

Families, and the launch package they share (dependencies one-way: a family uses ``launch``,
never another family; ``launch`` uses no family):
    launch/     one launch mechanism for every kernel: the specialization rule, compiled
                specializations per kernel, bound launches with packed arguments through
                ``cuLaunchKernelEx`` (``Launches``: an owner's launches of one kernel)
    copy/       the SM copy kernels of the transfer engines (``row``, ``tables``, ``pages``,
                ``blocks``) and their host staging (``staging``)
    mla/        the grouped MLA cache insert (``kernel``, ``checks``, ``reference``, ``plan``,
                ``insert``, ``memo``, ``api``, ``hook``)
    c128/       the DeepSeek-V4 c128 compressor (``layout``, ``gate``, ``reference``,
                ``kernel``, ``host``, ``bounds``, ``api``, ``hook``)
"""
