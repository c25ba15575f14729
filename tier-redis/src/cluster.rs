//! Redis Cluster: the cached slot map, and a batch split by the master
//! that owns each key's slot.
//!
//! Keys are grouped by master from a cached `CLUSTER SLOTS` map (slots
//! computed without building each name, see [`crate::slot`]); each group is
//! one [`Shard`] whose pipelines are routed to that master. When a shard's
//! pipeline fails (MOVED during resharding, a node down), the tier drops
//! the map ([`Cluster::forget`]) and asks that shard's keys one command at a
//! time, with the client library following MOVED / ASK.

use std::sync::{Arc, PoisonError, RwLock};

use kvtier_core::OffloadKey;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Pipeline, RedisResult, Value};
use tokio::sync::OnceCell;

use crate::io::Io;
use crate::lean::{self, LeanPool};
use crate::names::Names;
use crate::route::{ConnError, Placed, Shard, Target};
use crate::slot::SLOTS;

/// A Redis Cluster: its client, one connection (made on the tier's I/O
/// runtime, where its driver reconnects), and the slot map.
pub(crate) struct Cluster {
    client: ClusterClient,
    conn: OnceCell<ClusterConnection>,
    slots: RwLock<Option<Arc<SlotMap>>>,
    /// The seed's settings for masters' lean connections (host and port
    /// replaced), if the lean path is on and the seed is plain TCP.
    lean: Option<lean::Endpoint>,
    /// This tier's names, and their slots.
    names: Names,
}

/// The master owning each slot, from `CLUSTER SLOTS`.
#[derive(Debug)]
struct SlotMap {
    /// Each slot's master index, [`NO_OWNER`] for a slot no range covers:
    /// one load per key where a search of the ranges took several
    /// dependent ones (a cluster lookup places every key).
    owners: Box<[u16]>,
    masters: Vec<Master>,
}

/// In [`SlotMap::owners`], a slot without a known owner.
const NO_OWNER: u16 = u16::MAX;

#[derive(Debug)]
struct Master {
    host: String,
    port: u16,
    /// The lean path's connections to it.
    lean: Option<Arc<LeanPool>>,
}

impl SlotMap {
    fn owner(&self, slot: u16) -> Option<usize> {
        match self.owners.get(usize::from(slot)) {
            Some(&NO_OWNER) | None => None,
            Some(&master) => Some(usize::from(master)),
        }
    }
}

impl Cluster {
    pub(crate) fn new(client: ClusterClient, lean: Option<lean::Endpoint>, names: Names) -> Self {
        Self {
            client,
            conn: OnceCell::new(),
            slots: RwLock::new(None),
            lean,
            names,
        }
    }

    /// The cluster connection, made on `io` by the first call.
    pub(crate) async fn connection(&self, io: &Io) -> RedisResult<ClusterConnection> {
        self.conn
            .get_or_try_init(|| {
                let client = self.client.clone();
                io.run(async move { client.get_async_connection().await })
            })
            .await
            .cloned()
    }

    /// `pipe` routed to the master of `slot`.
    pub(crate) async fn pipeline(
        &self,
        io: &Io,
        slot: u16,
        pipe: Pipeline,
        replies: usize,
    ) -> RedisResult<Vec<Value>> {
        let mut conn = self.connection(io).await?;
        let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
        conn.route_pipeline(pipe, 0, replies, route).await
    }

    /// Positions of `keys`, with their slots (and tags' CRCs, see
    /// [`Placed`]), one shard per master; keys of slots without a known
    /// owner make a last shard, routed by its first key's slot.
    pub(crate) async fn shards(
        &self,
        io: &Io,
        keys: &[&OffloadKey],
    ) -> Result<Vec<Shard>, ConnError> {
        let map = self.slot_map(io).await?;
        // Room for a master's share and then some, so that with masters
        // owning equal ranges (keys spread evenly) no group grows by copies;
        // never more than the batch, none for slots without an owner.
        let share = keys.len() / map.masters.len().max(1);
        let room = (share + share / 4 + 16).min(keys.len());
        let mut groups: Vec<Vec<Placed>> = (0..map.masters.len())
            .map(|_| Vec::with_capacity(room))
            .chain([Vec::new()])
            .collect();
        for (pos, key) in keys.iter().enumerate() {
            let (slot, tag) = self.names.slot_and_tag(key.as_bytes());
            groups[map.owner(slot).unwrap_or(map.masters.len())].push(Placed { pos, slot, tag });
        }
        Ok(groups
            .into_iter()
            .enumerate()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(master, keys)| Shard {
                target: Target {
                    route: Some(keys[0].slot),
                    lean: map.masters.get(master).and_then(|m| m.lean.clone()),
                },
                keys,
            })
            .collect())
    }

    /// Drops the slot map; the next batch asks for it again.
    pub(crate) fn forget(&self) {
        *self.slots.write().unwrap_or_else(PoisonError::into_inner) = None;
    }

    async fn slot_map(&self, io: &Io) -> Result<Arc<SlotMap>, ConnError> {
        if let Some(map) = self
            .slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            return Ok(Arc::clone(map));
        }
        let mut conn = self.connection(io).await?;
        let reply: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await?;
        let mut map = parse_cluster_slots(reply)
            .ok_or_else(|| ConnError::Reply("CLUSTER SLOTS: not a slot map".to_owned()))?;
        if let Some(template) = &self.lean {
            for master in &mut map.masters {
                master.lean = Some(Arc::new(LeanPool::new(
                    lean::Endpoint {
                        // An empty host means "the address you reached me at".
                        host: if master.host.is_empty() {
                            template.host.clone()
                        } else {
                            master.host.clone()
                        },
                        port: master.port,
                        db: 0,
                        ..template.clone()
                    },
                    io.spawner().clone(),
                )));
            }
        }
        let map = Arc::new(map);
        *self.slots.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&map));
        Ok(map)
    }
}

/// Parses a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id], replicas...], ...]`.
fn parse_cluster_slots(reply: Value) -> Option<SlotMap> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let mut masters: Vec<Master> = Vec::new();
    let mut ranges = Vec::new();
    for entry in entries {
        let Value::Array(fields) = entry else {
            return None;
        };
        let mut fields = fields.into_iter();
        let start = redis::from_redis_value::<i64>(fields.next()?).ok()?;
        let end = redis::from_redis_value::<i64>(fields.next()?).ok()?;
        let Value::Array(master) = fields.next()? else {
            return None;
        };
        let mut master = master.into_iter();
        let host = redis::from_redis_value::<String>(master.next()?).ok()?;
        let port = u16::try_from(redis::from_redis_value::<i64>(master.next()?).ok()?).ok()?;
        let idx = match masters
            .iter()
            .position(|m| m.host == host && m.port == port)
        {
            Some(i) => i,
            None => {
                masters.push(Master {
                    host,
                    port,
                    lean: None,
                });
                masters.len() - 1
            }
        };
        ranges.push((u16::try_from(start).ok()?, u16::try_from(end).ok()?, idx));
    }
    // More masters than slots is not a cluster; the bound keeps every index
    // below NO_OWNER.
    if masters.len() > usize::from(SLOTS) {
        return None;
    }
    let mut owners = vec![NO_OWNER; usize::from(SLOTS)].into_boxed_slice();
    for (start, end, master) in ranges {
        // A range ending past the last slot covers up to it; a reversed one,
        // or one starting past the last slot, covers nothing. Where ranges
        // overlap (no cluster answers so), the later one wins.
        let end = usize::from(end).min(owners.len() - 1);
        for owner in owners.iter_mut().take(end + 1).skip(usize::from(start)) {
            *owner = master as u16;
        }
    }
    Some(SlotMap { owners, masters })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_maps_parse_and_find_owners() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(8192), Value::Int(16383), node("b", 2)]),
            Value::Array(vec![Value::Int(0), Value::Int(8000), node("a", 1)]),
        ]);
        let map = parse_cluster_slots(reply).unwrap();
        assert_eq!(map.masters.len(), 2);
        assert_eq!(map.owner(0).map(|m| &map.masters[m].host[..]), Some("a"));
        assert_eq!(map.owner(8100), None);
        assert_eq!(map.owner(16383).map(|m| map.masters[m].port), Some(2));
        assert!(parse_cluster_slots(Value::Int(1)).is_none());

        // Edges: an end past the last slot is clamped, a reversed range and
        // one starting past the last slot cover nothing, an empty reply
        // knows no owner, and no table index can reach NO_OWNER.
        let range = |start: i64, end: i64, host: &str| {
            Value::Array(vec![Value::Int(start), Value::Int(end), node(host, 1)])
        };
        let map = parse_cluster_slots(Value::Array(vec![
            range(16000, 20000, "a"),
            range(200, 100, "b"),
            range(17000, 17001, "c"),
            range(0, 10, "d"),
        ]))
        .unwrap();
        let host = |slot| map.owner(slot).map(|m| map.masters[m].host.clone());
        assert_eq!(host(16383).as_deref(), Some("a"));
        assert_eq!(host(15999), None);
        assert_eq!(host(150), None);
        assert_eq!(host(10).as_deref(), Some("d"));
        assert_eq!(host(11), None);
        let empty = parse_cluster_slots(Value::Array(vec![])).unwrap();
        assert!((0..SLOTS).all(|slot| empty.owner(slot).is_none()));
        let too_many: Vec<Value> = (0..=i64::from(SLOTS))
            .map(|i| range(0, 0, &format!("h{i}")))
            .collect();
        assert!(parse_cluster_slots(Value::Array(too_many)).is_none());
    }
}
