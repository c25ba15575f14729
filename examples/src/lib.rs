//! kvtier examples
