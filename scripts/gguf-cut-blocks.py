#!/usr/bin/env python3
"""Cut a Llama GGUF down to its first N blocks: the same metadata (block_count set to N), the
same tensors and data but the later blocks' (dropped with their bytes, the rest moved up). For
bisecting by depth, e.g. `hesper grad --check-f64` on SmolLM2 cut to 10 and 12 blocks, and for
taking the real model where only a smaller file fits (SmolLM2 at 10 blocks: ~45 MB of 98).

Usage: scripts/gguf-cut-blocks.py MODEL.gguf N OUT.gguf (no dependencies)
"""
import sys, struct
if len(sys.argv) != 4:
    sys.exit(__doc__)
src, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = open(src, 'rb').read()
pos = 0
def rd(fmt):
    global pos
    v = struct.unpack_from(fmt, b, pos); pos += struct.calcsize(fmt); return v[0] if len(v) == 1 else v
def rstr():
    global pos
    l = rd('<Q'); s = b[pos:pos+l]; pos += l; return s
sizes = {0:1,1:1,2:2,3:2,4:4,5:4,6:4,7:1,10:8,11:8,12:8}
def skip_val(t):
    global pos
    if t in sizes: pos += sizes[t]
    elif t == 8: rstr()
    elif t == 9:
        et = rd('<I'); cnt = rd('<Q')
        for _ in range(cnt): skip_val(et)
    else: raise ValueError(t)
magic = b[:4]; pos = 4
ver = rd('<I'); nt = rd('<Q'); nkv = rd('<Q')
kv_start = pos
kvs = []
align = 32
for _ in range(nkv):
    s0 = pos; key = rstr(); t = rd('<I'); v0 = pos; skip_val(t)
    raw = bytearray(b[s0:pos])
    if key == b'llama.block_count':
        struct.pack_into('<I', raw, v0 - s0, n)
    if key == b'general.alignment':
        align = struct.unpack_from('<I', b, v0)[0]
    kvs.append(bytes(raw))
tensors = []  # (info bytes without the offset, offset, kept)
for _ in range(nt):
    s0 = pos; name = rstr(); nd = rd('<I'); pos += 8 * nd; rd('<I'); s1 = pos; off = rd('<Q')
    keep = not name.startswith(b'blk.') or int(name.split(b'.')[1]) < n
    tensors.append((b[s0:s1], off, keep))
data_start = (pos + align - 1) // align * align
# A tensor's bytes run to the next tensor's offset (or the file's end): offsets are aligned.
ends = sorted(off for _, off, _ in tensors) + [len(b) - data_start]
size = {off: ends[i + 1] - off for i, off in enumerate(ends[:-1])}
infos, data, at = [], [], 0
for info, off, keep in tensors:
    if keep:
        infos.append(info + struct.pack('<Q', at))
        data.append(b[data_start + off:data_start + off + size[off]])
        at += size[off]
head = magic + struct.pack('<IQQ', ver, len(infos), nkv) + b''.join(kvs) + b''.join(infos)
head += b'\0' * ((-len(head)) % align)
open(out, 'wb').write(head + b''.join(data))
print(out, len(infos), 'tensors,', len(head) + at, 'bytes')
