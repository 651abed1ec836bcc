//! Per model, the model row and shape the gated reads last found recorded, so the next read
//! picks its clock rows by it and reads the topic identities again only after a change.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use parsley_store::documents::ShapeId;
use parsley_store::ordering::ModelRow;

/// A model's row as a gated statement last read it, and the shape it was recorded under.
#[derive(Debug)]
pub struct Recorded {
    pub shape: ShapeId,
    pub row: ModelRow,
}

/// Per model, the row the last gated statement that read it found recorded: the next
/// statement picks its clock rows by it, and has its topic identities read again only if the
/// recorded shape is no longer this one — in its own snapshot, so a changed shape is seen by
/// the very read that follows the change.
#[derive(Debug, Default)]
pub struct Shapes {
    models: RwLock<BTreeMap<String, Arc<Recorded>>>,
}

impl Shapes {
    pub fn get(&self, model: &str) -> Option<Arc<Recorded>> {
        self.models.read().unwrap_or_else(|e| e.into_inner()).get(model).cloned()
    }

    pub fn put(&self, model: &str, recorded: Option<Arc<Recorded>>) {
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        match recorded {
            Some(r) => models.insert(model.to_string(), r),
            None => models.remove(model),
        };
    }
}
