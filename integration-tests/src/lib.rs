//! Harness of kvtier's end-to-end tests. Finding the shared services and
//! starting private servers a test may kill live in `kvtier-test-services`,
//! shared with the tier crates' own tests; they are re-exported here.

#![deny(missing_docs)]

pub use kvtier_test_services::*;
