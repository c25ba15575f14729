//! The conformance checks of the in-place batch forms,
//! [`BlockStore::store_batch`] and [`BlockStore::load_batch`]: round trips
//! at 2 MiB and odd sizes, absent keys, regions of the wrong length,
//! duplicates and the empty batch, each loaded between canary bytes that
//! must stay untouched.

use crate::{BlockOutcome, BlockStore, OffloadKey, TierErrorKind};

use super::{Fixture, unique_keys};

/// The byte that fills every region before a load and the gaps between
/// regions: a load must leave it wherever it writes no block.
pub const CANARY: u8 = 0xA5;

/// Bytes of canary before, between and after the regions of a load.
const GAP: usize = 61;

/// A block of `len` bytes derived from `key`: another key's block, or a
/// shifted copy of this one, compares unequal.
pub fn block_of(key: &OffloadKey, len: usize) -> Vec<u8> {
    let mut seed = key
        .as_bytes()
        .iter()
        .fold(0xCBF2_9CE4_8422_2325u64 ^ len as u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
        });
    let mut block = Vec::with_capacity(len + 8);
    while block.len() < len {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        block.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    block.truncate(len);
    block
}

/// One host buffer holding regions of the given lengths, each preceded and
/// followed by [`GAP`] canary bytes, every byte set to [`CANARY`].
struct Regions {
    buf: Vec<u8>,
    spans: Vec<(usize, usize)>,
}

impl Regions {
    fn new(lens: &[usize]) -> Self {
        let mut spans = Vec::with_capacity(lens.len());
        let mut at = GAP;
        for &len in lens {
            spans.push((at, len));
            at += len + GAP;
        }
        Self {
            buf: vec![CANARY; at],
            spans,
        }
    }

    fn region(&self, i: usize) -> &[u8] {
        let (at, len) = self.spans[i];
        &self.buf[at..at + len]
    }

    /// `(key, region)` pairs over the buffer, for `load_batch`.
    fn borrow<'a>(&'a mut self, keys: &'a [OffloadKey]) -> Vec<(&'a OffloadKey, &'a mut [u8])> {
        let mut out = Vec::with_capacity(self.spans.len());
        let mut rest: &mut [u8] = &mut self.buf;
        let mut consumed = 0;
        for (key, &(at, len)) in keys.iter().zip(&self.spans) {
            let (_, tail) = rest.split_at_mut(at - consumed);
            let (region, tail) = tail.split_at_mut(len);
            out.push((key, region));
            rest = tail;
            consumed = at + len;
        }
        out
    }

    /// Whether every byte outside the regions is still the canary.
    fn gaps_intact(&self) -> bool {
        let mut from = 0;
        for &(at, len) in &self.spans {
            if self.buf[from..at].iter().any(|&b| b != CANARY) {
                return false;
            }
            from = at + len;
        }
        self.buf[from..].iter().all(|&b| b == CANARY)
    }
}

/// `(key, block)` pairs borrowed from owned blocks, as `store_batch` takes
/// them.
pub fn store_pairs(blocks: &[(OffloadKey, Vec<u8>)]) -> Vec<(&OffloadKey, &[u8])> {
    blocks.iter().map(|(k, b)| (k, b.as_slice())).collect()
}

/// Loads `keys` with `load_batch` into fresh regions of `lens` bytes, each
/// filled with `fill` first; checks that there is one outcome per key.
pub async fn load_regions<S: BlockStore>(
    tier: &S,
    keys: &[OffloadKey],
    lens: &[usize],
    fill: u8,
) -> (Vec<BlockOutcome>, Vec<Vec<u8>>) {
    let mut regions: Vec<Vec<u8>> = lens.iter().map(|&len| vec![fill; len]).collect();
    let outcomes = {
        let mut batch: Vec<(&OffloadKey, &mut [u8])> = keys
            .iter()
            .zip(regions.iter_mut())
            .map(|(k, r)| (k, r.as_mut_slice()))
            .collect();
        tier.load_batch(&mut batch).await
    };
    assert_eq!(outcomes.len(), keys.len(), "one outcome per key");
    (outcomes, regions)
}

async fn store_all<S: BlockStore>(fixture: &Fixture<S>, blocks: &[(OffloadKey, Vec<u8>)]) {
    let name = fixture.name();
    let batch = store_pairs(blocks);
    let outcomes = fixture.tier().store_batch(&batch).await;
    assert_eq!(
        outcomes.len(),
        blocks.len(),
        "{name}: store_batch must answer one outcome per block"
    );
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(
            outcome.is_done(),
            "{name}: store_batch of block {i} ({} bytes): {outcome:?}",
            blocks[i].1.len()
        );
    }
}

async fn load_into<S: BlockStore>(
    fixture: &Fixture<S>,
    keys: &[OffloadKey],
    lens: &[usize],
) -> (Vec<BlockOutcome>, Regions) {
    let mut regions = Regions::new(lens);
    let outcomes = {
        let mut batch = regions.borrow(keys);
        fixture.tier().load_batch(&mut batch).await
    };
    assert_eq!(
        outcomes.len(),
        keys.len(),
        "{}: load_batch must answer one outcome per key",
        fixture.name()
    );
    assert!(
        regions.gaps_intact(),
        "{}: load_batch wrote outside its regions",
        fixture.name()
    );
    (outcomes, regions)
}

/// Blocks of 2 MiB and of odd sizes stored with `store_batch` load back
/// byte for byte with `load_batch` (between canaries) and with `load`; a
/// block stored with `store` loads with `load_batch`.
pub async fn batch_round_trip<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let lens = [2 << 20, 1, 7, 4097, 65_537, 2 << 20, 300_001];
    let keys = unique_keys(lens.len() + 1, fixture.key_len());
    let blocks: Vec<(OffloadKey, Vec<u8>)> = keys[..lens.len()]
        .iter()
        .zip(lens)
        .map(|(k, len)| (k.clone(), block_of(k, len)))
        .collect();
    store_all(fixture, &blocks).await;
    let (outcomes, regions) = load_into(fixture, &keys[..lens.len()], &lens).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(
            outcome.is_done(),
            "{name}: load_batch of block {i}: {outcome:?}"
        );
        assert!(
            regions.region(i) == blocks[i].1.as_slice(),
            "{name}: block {i} ({} bytes) did not load back byte for byte",
            lens[i]
        );
    }
    match fixture.tier().load(&keys[2]).await {
        Ok(Some(block)) => assert_eq!(block, blocks[2].1, "{name}: load after store_batch"),
        other => panic!("{name}: load after store_batch: {other:?}"),
    }
    let single = block_of(&keys[lens.len()], 12_345);
    if let Err(err) = fixture.tier().store(&keys[lens.len()], &single).await {
        panic!("{name}: store failed: {err}");
    }
    let (outcomes, regions) = load_into(fixture, &keys[lens.len()..], &[single.len()]).await;
    assert!(
        outcomes[0].is_done() && regions.region(0) == single.as_slice(),
        "{name}: load_batch after store: {:?}",
        outcomes[0]
    );
}

/// Keys never stored answer `Absent` and leave their regions as they were,
/// between present keys that load.
pub async fn batch_absent_keys<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(6, fixture.key_len());
    let lens = [100, 200, 300, 400, 500, 600];
    let blocks: Vec<(OffloadKey, Vec<u8>)> = [0, 3]
        .iter()
        .map(|&i| (keys[i].clone(), block_of(&keys[i], lens[i])))
        .collect();
    store_all(fixture, &blocks).await;
    let (outcomes, regions) = load_into(fixture, &keys, &lens).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        if i == 0 || i == 3 {
            assert!(
                outcome.is_done() && regions.region(i) == block_of(&keys[i], lens[i]).as_slice(),
                "{name}: present key {i}: {outcome:?}"
            );
        } else {
            assert!(
                matches!(outcome, BlockOutcome::Absent),
                "{name}: a key never stored must answer Absent, key {i} answered {outcome:?}"
            );
            assert!(
                regions.region(i).iter().all(|&b| b == CANARY),
                "{name}: an absent key's region must be left as it was"
            );
        }
    }
}

/// A region shorter or longer than the stored block is a `LengthMismatch`
/// for that key, its region untouched; the other keys of the batch load.
pub async fn batch_wrong_length_regions<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(3, fixture.key_len());
    let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .map(|k| (k.clone(), block_of(k, 1000)))
        .collect();
    store_all(fixture, &blocks).await;
    let lens = [999, 1000, 1001];
    let (outcomes, regions) = load_into(fixture, &keys, &lens).await;
    for i in [0, 2] {
        match &outcomes[i] {
            BlockOutcome::Failed(err) => {
                assert_eq!(
                    err.kind(),
                    TierErrorKind::LengthMismatch,
                    "{name}: a region of {} bytes for a block of 1000: {err}",
                    lens[i]
                );
                let source = std::error::Error::source(err.as_ref())
                    .and_then(|s| s.downcast_ref::<crate::LengthMismatch>());
                assert_eq!(
                    source,
                    Some(&crate::LengthMismatch {
                        stored: 1000,
                        region: lens[i]
                    }),
                    "{name}: the error's source must say both lengths"
                );
            }
            other => panic!(
                "{name}: a region of {} bytes for a block of 1000 must fail with LengthMismatch, got {other:?}",
                lens[i]
            ),
        }
        assert!(
            regions.region(i).iter().all(|&b| b == CANARY),
            "{name}: a region of the wrong length must be left as it was"
        );
    }
    assert!(
        outcomes[1].is_done() && regions.region(1) == blocks[1].1.as_slice(),
        "{name}: the key between two mismatches: {:?}",
        outcomes[1]
    );
}

/// A key stored twice in one batch ends with its last block; a key loaded
/// twice in one batch fills both regions.
pub async fn batch_duplicates<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(2, fixture.key_len());
    let first = block_of(&keys[1], 512);
    let last: Vec<u8> = first.iter().map(|b| b ^ 0xFF).collect();
    let blocks = vec![
        (keys[0].clone(), block_of(&keys[0], 512)),
        (keys[1].clone(), first),
        (keys[1].clone(), last.clone()),
    ];
    store_all(fixture, &blocks).await;
    let batch = [keys[1].clone(), keys[0].clone(), keys[1].clone()];
    let (outcomes, regions) = load_into(fixture, &batch, &[512, 512, 512]).await;
    assert!(
        outcomes.iter().all(BlockOutcome::is_done),
        "{name}: duplicates: {outcomes:?}"
    );
    assert!(
        regions.region(0) == last.as_slice() && regions.region(2) == last.as_slice(),
        "{name}: a key stored twice in a batch must keep its last block, in both regions loading it"
    );
    assert!(
        regions.region(1) == blocks[0].1.as_slice(),
        "{name}: duplicates: the key between them"
    );
}

/// Empty batches answer nothing.
pub async fn batch_empty<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    assert!(
        fixture.tier().store_batch(&[]).await.is_empty(),
        "{name}: an empty store_batch must answer an empty vector"
    );
    assert!(
        fixture.tier().load_batch(&mut []).await.is_empty(),
        "{name}: an empty load_batch must answer an empty vector"
    );
}

/// [`BlockStore::known_len`], where a store answers it, is the length last
/// stored under the key, and `None` for a key never stored or removed.
pub async fn known_len_agrees_with_the_store<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(3, fixture.key_len());
    let blocks = vec![
        (keys[0].clone(), block_of(&keys[0], 4097)),
        (keys[1].clone(), block_of(&keys[1], 10)),
    ];
    store_all(fixture, &blocks).await;
    let tier = fixture.tier();
    for (key, block) in &blocks {
        let known = tier.known_len(key);
        assert!(
            known.is_none() || known == Some(block.len()),
            "{name}: known_len {known:?} for a block of {} bytes",
            block.len()
        );
    }
    assert_eq!(
        tier.known_len(&keys[2]),
        None,
        "{name}: known_len of a key never stored"
    );
    let longer = block_of(&keys[1], 300);
    store_all(fixture, &[(keys[1].clone(), longer)]).await;
    let known = tier.known_len(&keys[1]);
    assert!(
        known.is_none() || known == Some(300),
        "{name}: known_len {known:?} after the block was stored again with 300 bytes"
    );
    if let Err(err) = tier.remove(&keys[0]).await {
        panic!("{name}: remove failed: {err}");
    }
    assert_eq!(
        tier.known_len(&keys[0]),
        None,
        "{name}: known_len of a removed key"
    );
}

/// Every batch-form check above, in turn.
pub async fn batch_forms<S: BlockStore>(fixture: &Fixture<S>) {
    batch_empty(fixture).await;
    batch_round_trip(fixture).await;
    batch_absent_keys(fixture).await;
    batch_wrong_length_regions(fixture).await;
    batch_duplicates(fixture).await;
    known_len_agrees_with_the_store(fixture).await;
}
