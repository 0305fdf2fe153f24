"""Hidden-state shards: what ``datagen.capture`` writes and offline training reads.

Modules: ``format`` (the constants, meta.json and the index files), ``writer`` (ShardWriter,
finalize), ``integrity`` (checksums, verify_shards, repair, the recapture command),
``dataset`` (ShardDataset, what training reads). This docstring is the on-disk contract.

Directory layout (``format_version`` 1)::

    DIR/meta.json            what the data is (see below); "complete": true once a run finished
    DIR/index.jsonl          one line per record: {"id", "dataset", "shard", "offset", "length",
                             "num_loss_tokens", "xxh3", "shard_bytes", "shard_xxh3"}, in
                             (shard, offset) order (the last three: see Integrity below)
    DIR/shard-PPP-NNNNN.safetensors   records of writer PPP (one per process), concatenated
                             along the token axis; a record is rows [offset, offset + length)

Tensors in a shard (N = tokens in the shard, H = target hidden size)::

    input_ids   int32  [N]
    loss_mask   uint8  [N]      1 on tokens the target generated (eagle3.data.chat); in a
                                rollout's capture (datagen.rollout) a verification root holds
                                1 + the draft depths verification judged from there
    aux_hidden  dtype  [N, 3H]  outputs of the 3 aux decoder layers, concatenated in order
    last_hidden dtype  [N, H]   final hidden state after the last norm (lm_head input)
    aux_scale   fp32   [N, 3]   when aux_hidden is fp8: one scale per token and aux layer
    last_scale  fp32   [N, 1]   when last_hidden is fp8

Storage modes (``--dtype``) and bytes per token (ids 4 + mask 1 + hidden values + fp8 scales)::

    mode     aux_hidden  last_hidden  bytes    SmolLM2 (H=576)  Kimi-K2.5 (H=7168)
    bf16     bf16        bf16         8H + 5   4,613 B          57,349 B
    fp16     fp16        fp16         8H + 5   same; values beyond +-65504 are clamped (warned)
    fp8      fp8         fp8          4H + 21  2,325 B          28,693 B
    fp8-aux  fp8         bf16         5H + 17  2,897 B          35,857 B

fp8 is ``torch.float8_e4m3fn`` with a per-token, per-layer absmax scale (the three aux layers
differ in magnitude by orders), so each value keeps ~3 significant bits of mantissa relative
to its row's largest value. ``fp8`` halves the disk of bf16 but moves the soft labels' top-1
(the last hidden state's outlier channels set its scale and squeeze the other values);
``fp8-aux`` stores only the aux states (the drafter's input) in fp8 and the last hidden state
(the labels' source) as bf16, bit-identical to a bf16 capture's, for 37.5% less disk than bf16.
At Kimi-K2.5 size, 40M training tokens are 2.3 TB in bf16, 1.4 TB in fp8-aux, 1.1 TB in fp8.
What each costs the labels and the aux states, measured: results/README.md, "Soft labels and
the drafter's input from fp8 shards". meta.json's ``fp8_scales`` names each fp8 tensor's scale
tensor (``{}`` when none); a capture from before it has none and reads by its ``dtype`` (fp8:
both tensors).

Crash safety: a shard is written to ``.NAME.tmp``, fsynced and renamed; only then are its index
lines appended (one write) to the writer's ``index-PPP.jsonl`` part. A record is captured when
its index line exists, so a crash can leave at worst an unreferenced shard or a temp file, which
the next writer of that part deletes; a half-written shard is never read as whole.
:func:`finalize` merges the parts into ``index.jsonl`` and sets ``"complete": true``.
:func:`repair` (a resume dropping damaged shards) marks meta incomplete, rewrites each index file
(temp + rename) without the damaged shards' lines and only then deletes the files, so a crash
in between leaves at worst unreferenced shards, cleaned up as above. Shards are
written by a background thread, one at a time, while the next one fills (the target keeps
computing during the disk write).

meta.json carries what training checks before using the data (``target``, ``vocab_size``,
``target_hidden_size``, ``aux_layer_ids``, ``num_layers``, and ``tokenizer_fingerprint``: a
hash of the ids the capture's tokenizer gives a probe text, eagle3.targets.tokenizer; captures
written before it only warn), provenance (``sources``,
``models``/``providers`` of the responses, token counts, the capture summary) and ``command``:
the ``datagen.capture`` flags of the last run (less ``--out``), which error messages turn into
the command that recaptures damaged shards.

Integrity. Every index line records what its shard must be, ``shard_bytes`` (the file's size)
and ``shard_xxh3`` (XXH3-64 of the whole file, 16 hex digits), and what its own record must
read as, ``xxh3``: the XXH3-64 of the record's rows of every tensor of the shard, tensors in
name order, each as its stored bytes. A shard's lines repeat its two fields so that the one
append that publishes a record publishes them too: no second file to keep in step or merge.
XXH3 (the ``xxhash`` package), not sha256: the damage to catch is accidental (a full disk, a
copy cut short, a bad sector), not forged, and it is the fastest of the three measured;
``xxhsum -H3 FILE`` prints the same digest. Writing, both run on the writer thread beside the
target's forward; reading, a record's check runs only on the record's first read in a process.
What they cost, measured: results/README.md, "Shard checksums". Who checks what:

- :class:`ShardDataset` (training), at construction: every shard is there with its size (a
  stat). On a record's first read in a process: its ``xxh3``, over the bytes the read fetches
  anyway, so no rank or DataLoader worker reads anything twice (a whole-shard check on first
  open would, in each of them). Either failure is an Eagle3Error naming the shard, how many
  records it held and the command that recaptures them (eagle3.cli prints it as one line,
  also when a DataLoader worker raised it).
- ``python -m datagen.capture --verify --out DIR``: size and ``shard_xxh3`` of every shard, one
  line per damaged or missing one, exit 0 when all are intact and 1 when not.
- A capture resume (the same command and --out) verifies the same way first, drops the index
  lines of damaged or missing shards, removes their files, and so captures exactly their
  records again; every other shard stays byte-identical. (On a large capture that read is the
  price of a resume: the disk's speed, VERIFY_THREADS shards at a time.)

Captures written before these fields still load: a shard then is checked against the size its
own safetensors header implies (which finds a truncation, not flipped bytes), and the
recapture command is rebuilt from meta.json (its ``target``, ``sources``, ``dtype``,
``max_length``), to be checked against the flags the capture used.
"""

from eagle3.data.shards.dataset import ShardDataset
from eagle3.data.shards.format import (
    DTYPES,
    FORMAT_VERSION,
    IDENTITY_KEYS,
    bytes_per_token,
    check_meta,
    fp8_scales,
    identity_mismatches,
    read_index,
    read_meta,
    target_meta,
)
from eagle3.data.shards.integrity import (
    ShardProblem,
    file_xxh3,
    recapture_command,
    record_xxh3,
    repair,
    verify_shards,
)
from eagle3.data.shards.writer import ShardWriter, finalize

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "IDENTITY_KEYS",
    "ShardDataset",
    "ShardProblem",
    "ShardWriter",
    "bytes_per_token",
    "check_meta",
    "file_xxh3",
    "finalize",
    "fp8_scales",
    "identity_mismatches",
    "read_index",
    "read_meta",
    "recapture_command",
    "record_xxh3",
    "repair",
    "target_meta",
    "verify_shards",
]
