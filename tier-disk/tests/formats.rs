//! Fuzzing the parsers with proptest: arbitrary bytes never panic, and
//! every encoded value parses back to itself. (cargo-fuzz targets would
//! need a nightly toolchain, which this project's CI does not have; this
//! runs a bounded number of cases on stable in every CI run.)

use kvtier_disk::format::{
    self, Counters, HEADER_SIZE, IndexHeader, Location, Slot, encode_live_slot, encode_record,
    parse_record, parse_record_header, parse_slot,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn parsers_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..6000), key_len in 1usize..80) {
        let _ = IndexHeader::parse(&bytes);
        let _ = Counters::parse(&bytes);
        let _ = parse_slot(&bytes, key_len);
        let _ = format::slot_tag_and_key(&bytes, key_len);
        let _ = parse_record_header(&bytes);
        let _ = parse_record(&bytes);
        let _ = format::stable_hash(&bytes);
    }

    #[test]
    fn a_valid_header_with_one_flipped_bit_is_rejected_or_equal(key_len in 1u32..200, shift in 4u32..30, bit in 0usize..(64 * 8)) {
        let header = IndexHeader { key_len, slot_count: 1 << shift, created_unix: 1_700_000_000 };
        let mut buf = vec![0u8; HEADER_SIZE];
        header.encode(&mut buf);
        prop_assert_eq!(IndexHeader::parse(&buf), Ok(header));
        buf[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(IndexHeader::parse(&buf).is_err());
    }

    #[test]
    fn slots_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), segment: u64, offset: u64, len: u32, crc: u32, bit in 8usize..(40 * 8)) {
        let location = Location { segment, offset, payload_len: len, payload_crc: crc, record_len: len / 2 };
        let mut buf = vec![0u8; format::slot_size(key.len())];
        encode_live_slot(&mut buf, &key, &location);
        prop_assert_eq!(parse_slot(&buf, key.len()), Slot::Live { key: &key, location });
        buf[bit / 8] ^= 1 << (bit % 8);
        let still_live = matches!(parse_slot(&buf, key.len()), Slot::Live { .. });
        prop_assert!(!still_live, "a flipped bit went unnoticed");
    }

    #[test]
    fn records_round_trip_and_detect_any_flipped_bit(key in proptest::collection::vec(any::<u8>(), 1..64), payload in proptest::collection::vec(any::<u8>(), 0..300), bit: usize) {
        let record = encode_record(format::KIND_PUT, &key, &payload);
        let (header, k, p) = parse_record(&record).unwrap();
        prop_assert_eq!(header.record_len(), record.len());
        prop_assert_eq!(k, &key[..]);
        prop_assert_eq!(p, &payload[..]);
        let meaningful = format::RECORD_HEADER_SIZE + key.len() + payload.len();
        let mut damaged = record.clone();
        let at = bit % (meaningful * 8);
        damaged[at / 8] ^= 1 << (at % 8);
        prop_assert!(parse_record(&damaged).is_err());
    }
}
