//! Reads: paginated snapshot lists and watch starts.

use std::sync::Arc;

use serde_json::{Value, json};

use super::*;

pub(super) fn continue_encode(rv: u64, after: &ObjKey) -> String {
    let doc = json!({"v": "meta.k8s.io/v1", "rv": rv, "ns": after.namespace, "name": after.name});
    doc.to_string()
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(super) fn continue_decode(token: &str) -> Option<(u64, ObjKey)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| {
            token
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect();
    let doc: Value = serde_json::from_slice(&bytes?).ok()?;
    let rv = doc["rv"].as_u64()?;
    let key = ObjKey::new(doc["ns"].as_str()?, doc["name"].as_str()?);
    Some((rv, key))
}

impl Store {
    /// The objects of `res` as of `rv` (which must not be compacted), as
    /// overrides of the current state: `None` = did not exist then.
    fn overrides_at(&self, res: usize, rv: u64) -> BTreeMap<ObjKey, Option<Obj>> {
        let mut overrides = BTreeMap::new();
        let start = self.history.partition_point(|c| c.rv <= rv);
        for change in self.history.range(start..).filter(|c| c.res == res) {
            overrides
                .entry(change.key.clone())
                .or_insert_with(|| change.prev.clone());
        }
        overrides
    }

    fn check_readable(&self, requested: u64) -> Result<(), ApiError> {
        if requested > self.rv {
            return Err(ApiError::TooLargeResourceVersion {
                requested,
                current: self.rv,
            });
        }
        if requested < self.compacted {
            return Err(ApiError::TooOldResourceVersion {
                requested,
                oldest: self.compacted,
            });
        }
        Ok(())
    }

    /// Where a list reads: the revision it sees, and the key it continues after
    /// (a continue token's), or the revision its `resourceVersion` asks for.
    fn list_from(&self, q: &ListQuery<'_>) -> Result<(u64, Option<ObjKey>), ApiError> {
        Ok(match q.continue_token {
            Some(token) => {
                let (rv, key) =
                    continue_decode(token).ok_or_else(|| ApiError::InvalidContinue {
                        token: token.to_owned(),
                    })?;
                if rv < self.compacted {
                    return Err(ApiError::ContinueExpired);
                }
                if rv > self.rv {
                    return Err(ApiError::InvalidContinue {
                        token: token.to_owned(),
                    });
                }
                (rv, Some(key))
            }
            None => match q.version {
                ReadVersion::Latest => (self.rv, None),
                ReadVersion::NotOlderThan(rv) => {
                    if rv > self.rv {
                        return Err(ApiError::TooLargeResourceVersion {
                            requested: rv,
                            current: self.rv,
                        });
                    }
                    (self.rv, None)
                }
                ReadVersion::Exact(rv) => {
                    self.check_readable(rv)?;
                    (rv, None)
                }
            },
        })
    }

    pub(crate) fn list(
        &self,
        res: usize,
        namespace: Option<&str>,
        q: &ListQuery<'_>,
    ) -> Result<ListPage, ApiError> {
        let spec = self.spec(res);
        let (snapshot, after) = self.list_from(q)?;
        let overrides = if snapshot < self.rv {
            self.overrides_at(res, snapshot)
        } else {
            BTreeMap::new()
        };
        let lower = match &after {
            Some(k) => Bound::Excluded(k.clone()),
            None => match namespace {
                Some(ns) => Bound::Included(ObjKey::new(ns, "")),
                None => Bound::Unbounded,
            },
        };
        let objects = &self.resources[res].objects;
        let mut current = objects.range((lower.clone(), Bound::Unbounded)).peekable();
        let mut past = overrides.range((lower, Bound::Unbounded)).peekable();
        // Merge the current state with the overrides into the state at `snapshot`.
        let view = std::iter::from_fn(move || {
            loop {
                let take_current = match (current.peek(), past.peek()) {
                    (None, None) => return None,
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (Some((ck, _)), Some((pk, _))) => ck < pk,
                };
                if take_current {
                    let (k, o) = current.next()?;
                    return Some((k, Arc::clone(o)));
                }
                let (k, o) = past.next()?;
                if current.peek().is_some_and(|(ck, _)| *ck == k) {
                    current.next();
                }
                if let Some(o) = o {
                    return Some((k, Arc::clone(o)));
                }
            }
        });
        let in_scope = |k: &ObjKey| namespace.is_none_or(|ns| k.namespace == ns);
        let mut items = Vec::new();
        let mut last_key = None;
        let mut continue_token = None;
        let mut remaining = None;
        let selecting = !q.label.is_empty() || !q.field.is_empty();
        let mut view = view
            .take_while(|(k, _)| namespace.is_none_or(|ns| k.namespace.as_str() <= ns))
            .filter(|(k, o)| in_scope(k) && matches(spec, q.label, q.field, o));
        for (k, o) in view.by_ref() {
            if q.limit.is_some_and(|l| l > 0 && items.len() >= l) {
                if let Some(last) = &last_key {
                    continue_token = Some(continue_encode(snapshot, last));
                }
                if !selecting {
                    remaining = Some(1 + view.count() as u64);
                }
                break;
            }
            last_key = Some(k.clone());
            items.push(o);
        }
        Ok(ListPage {
            items,
            rv: snapshot,
            continue_token,
            remaining,
        })
    }

    /// Start a watch: what to send first, and a channel for what follows.
    pub(crate) fn watch_open(
        &mut self,
        res: usize,
        namespace: Option<&str>,
        from: WatchFrom,
        send_initial: bool,
        label: &LabelSelector,
        field: &FieldSelector,
    ) -> Result<WatchOpen, ApiError> {
        let mut initial = Vec::new();
        let mut replay = Vec::new();
        let current_state = match from {
            WatchFrom::Current => true,
            WatchFrom::After(rv) => {
                if rv < self.compacted {
                    return Err(ApiError::TooOldResourceVersion {
                        requested: rv,
                        oldest: self.compacted,
                    });
                }
                send_initial
            }
        };
        if current_state {
            let spec = self.spec(res);
            initial = self.resources[res]
                .objects
                .iter()
                .filter(|(k, o)| {
                    namespace.is_none_or(|ns| k.namespace == ns) && matches(spec, label, field, o)
                })
                .map(|(_, o)| Arc::clone(o))
                .collect();
        } else if let WatchFrom::After(rv) = from {
            let start = self.history.partition_point(|c| c.rv <= rv);
            replay = self
                .history
                .range(start..)
                .filter(|c| c.res == res)
                .cloned()
                .collect();
        }
        let (tx, rx) = mpsc::channel(self.watch_buffer);
        self.watchers.retain(|w| !w.tx.is_closed());
        self.watchers.push(WatchSlot { res, tx });
        Ok(WatchOpen {
            initial,
            replay,
            rx,
            rv: self.rv,
        })
    }
}
