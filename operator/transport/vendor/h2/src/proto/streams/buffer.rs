use slab::Slab;

/// Buffers frames for multiple streams.
#[derive(Debug)]
pub struct Buffer<T> {
    slab: Slab<Slot<T>>,
}

/// A sequence of frames in a `Buffer`
#[derive(Debug)]
pub struct Deque {
    indices: Option<Indices>,
}

/// Tracks the head & tail for a sequence of frames in a `Buffer`.
#[derive(Debug, Default, Copy, Clone)]
struct Indices {
    head: usize,
    tail: usize,
}

#[derive(Debug)]
struct Slot<T> {
    value: T,
    next: Option<usize>,
}

impl<T> Buffer<T> {
    pub fn new() -> Self {
        Buffer { slab: Slab::new() }
    }

    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// census: the slab's capacity, for the test of when it is held.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.slab.capacity()
    }
}

impl Deque {
    pub fn new() -> Self {
        Deque { indices: None }
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_none()
    }

    pub fn push_back<T>(&mut self, buf: &mut Buffer<T>, value: T) {
        let key = buf.slab.insert(Slot { value, next: None });

        match self.indices {
            Some(ref mut idxs) => {
                buf.slab[idxs.tail].next = Some(key);
                idxs.tail = key;
            }
            None => {
                self.indices = Some(Indices {
                    head: key,
                    tail: key,
                });
            }
        }
    }

    pub fn push_front<T>(&mut self, buf: &mut Buffer<T>, value: T) {
        let key = buf.slab.insert(Slot { value, next: None });

        match self.indices {
            Some(ref mut idxs) => {
                buf.slab[key].next = Some(idxs.head);
                idxs.head = key;
            }
            None => {
                self.indices = Some(Indices {
                    head: key,
                    tail: key,
                });
            }
        }
    }

    pub fn pop_front<T>(&mut self, buf: &mut Buffer<T>) -> Option<T> {
        match self.indices {
            Some(mut idxs) => {
                let mut slot = buf.slab.remove(idxs.head);

                // census: the last frame of every queue is out: give the slab's
                // storage back (no key is live, so none is invalidated). It grows to
                // the most frames ever queued at once (a large response waiting for
                // window) and would otherwise keep that for the connection's life.
                if buf.slab.is_empty() && buf.slab.capacity() != 0 {
                    buf.slab = Slab::new();
                }

                if idxs.head == idxs.tail {
                    assert!(slot.next.is_none());
                    self.indices = None;
                } else {
                    idxs.head = slot.next.take().unwrap();
                    self.indices = Some(idxs);
                }

                Some(slot.value)
            }
            None => None,
        }
    }
}

// census: a drained buffer holds no storage.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drained_buffer_holds_no_storage() {
        let mut buf = Buffer::new();
        let (mut a, mut b) = (Deque::new(), Deque::new());
        for i in 0..64 {
            a.push_back(&mut buf, i);
            b.push_front(&mut buf, 100 + i);
        }
        assert!(buf.capacity() >= 128);
        for i in 0..64 {
            assert_eq!(a.pop_front(&mut buf), Some(i));
        }
        assert!(
            buf.capacity() >= 128,
            "frames still queued keep the storage"
        );
        for i in (0..64).rev() {
            assert_eq!(b.pop_front(&mut buf), Some(100 + i));
        }
        assert!(a.is_empty() && b.is_empty() && buf.is_empty());
        assert_eq!(buf.capacity(), 0, "drained: no storage held");

        // And it grows again as frames are queued.
        a.push_back(&mut buf, 7);
        assert_eq!(a.pop_front(&mut buf), Some(7));
        assert_eq!(buf.capacity(), 0);
    }
}
