# Types for the compiled build of allocator.py (setup.py compiles that same file with Cython where a C compiler
# is at hand; the interpreted module is the reference, and tests/test_allocator_compiled.py holds the two to
# the same state on random event streams). Nothing here changes what the code does: it says which objects are
# blocks and which names hold machine integers, so that the replay loop reads fields instead of attributes
# and searches the free lists with C compares (_first_at_least, _first_above). Sizes (bytes) and addresses
# (512-byte units) are below 2**62 (the estimator refuses larger steps); the loop runs only while the
# free-list keys are packed (below 2**62: allocator.py, _UNIT), and the build checks C integer overflow anyway.
cimport cython

cdef class _Block:
    cdef public Py_ssize_t addr, size, segment
    cdef public bint free
    cdef public _Block prev, next

@cython.locals(block=_Block, prev=_Block, nxt=_Block, after=_Block, tail=_Block, sfree=list, lfree=list,
               scached=list, lcached=list, free=list, cached=list, i=Py_ssize_t, tiny=bint, n=Py_ssize_t,
               e=Py_ssize_t, taken=Py_ssize_t, live=dict, size=Py_ssize_t, rest=Py_ssize_t,
               addr=Py_ssize_t, seg=Py_ssize_t, allocated=Py_ssize_t, peak=Py_ssize_t, next_addr=Py_ssize_t,
               reserved=Py_ssize_t, min_block=Py_ssize_t, small_size=Py_ssize_t, small_buffer=Py_ssize_t,
               large_buffer=Py_ssize_t, min_large=Py_ssize_t, round_large=Py_ssize_t, shift=Py_ssize_t,
               unit=Py_ssize_t, limit=Py_ssize_t, end=Py_ssize_t, cut=Py_ssize_t, typed=bint)
cpdef Py_ssize_t _replay_events(alloc, list ids, list nbytes) except -1

@cython.locals(lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t, k=Py_ssize_t)
cdef Py_ssize_t _first_at_least(list keys, Py_ssize_t key)

@cython.locals(lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t, k=Py_ssize_t)
cdef Py_ssize_t _first_above(list keys, Py_ssize_t key)
