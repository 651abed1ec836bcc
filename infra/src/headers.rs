//! Record headers read as bytes.
//!
//! Kafka header names are arbitrary bytes on the wire, and any non-Java producer can write
//! one that is not UTF-8. The safe `rdkafka` accessors (`Headers::iter`, `get`, `try_get`)
//! turn every name into `&str` with an `unwrap`, so such a record would panic the consumer.
//! This module reads names and values through librdkafka's `rd_kafka_header_get_all`
//! instead, copying them into owned bytes. It is the second module allowed to use `unsafe`
//! (after `topic_id.rs`); every block carries its own safety argument.
//!
//! librdkafka hands a header name out as a NUL-terminated C string without its length, so
//! a name is read up to its first NUL byte: a name with an embedded NUL is read shortened.
//! Values carry their length and are read whole.
//!
//! Ownership rules relied on (librdkafka's `rdkafka.h`):
//! - `rd_kafka_message_headers` returns headers owned by the message (parsed on first use),
//!   valid while the message lives; the caller must not destroy them.
//! - `rd_kafka_header_get_all` returns pointers into those headers, valid as long as they
//!   are; everything is copied before this module returns.
//! - (test support) `rd_kafka_produceva` copies topic, key, value and headers when
//!   `RD_KAFKA_MSG_F_COPY` is set; an error it returns is ours to destroy.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::os::raw::c_char;
use std::ptr;

use rdkafka::message::BorrowedMessage;
use rdkafka_sys as sys;

/// One header: its name and its value (`None`: a header with a null value), as bytes.
pub type RawHeader = (Vec<u8>, Option<Vec<u8>>);

/// The headers of `message` in record order, names and values as bytes (never a panic,
/// whatever the bytes).
pub fn message_headers(message: &BorrowedMessage<'_>) -> Vec<RawHeader> {
    let mut out = Vec::new();
    for_each_header(message, |name, value| out.push((name.to_vec(), value.map(<[u8]>::to_vec))));
    out
}

/// Calls `visit` with each header of `message` in record order, its name and value (`None`:
/// a null value) borrowed from the message — for a reader that copies only what it keeps.
pub fn for_each_header(message: &BorrowedMessage<'_>, mut visit: impl FnMut(&[u8], Option<&[u8]>)) {
    let mut hdrs: *mut sys::rd_kafka_headers_t = ptr::null_mut();
    // SAFETY: `message.ptr()` is the live native message that `message` borrows for this
    // whole function; librdkafka writes a pointer to headers the message owns into `hdrs`.
    let err = unsafe { sys::rd_kafka_message_headers(message.ptr(), &mut hdrs) };
    if err != sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
        // `_NOENT`: the record has no headers.
        return;
    }
    // SAFETY: `hdrs` points to the message's live headers (see above).
    let count = unsafe { sys::rd_kafka_header_cnt(hdrs) };
    for idx in 0..count {
        let mut name: *const c_char = ptr::null();
        let mut value: *const std::os::raw::c_void = ptr::null();
        let mut size: usize = 0;
        // SAFETY: `hdrs` is live and `idx < count`; librdkafka writes pointers into the
        // headers (valid while the message lives) and the value's length.
        let err = unsafe { sys::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
        if err != sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            break;
        }
        // SAFETY: librdkafka stores every header name NUL-terminated; the pointer is valid
        // while the message lives, and `visit` only borrows it for this call.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        // SAFETY: a non-null value points to `size` bytes owned by the headers, valid while
        // the message lives; borrowed for this call.
        let value = (!value.is_null()).then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) });
        visit(name, value);
    }
}

/// Producing records whose header names are raw bytes, for the integration tests: the safe
/// `rdkafka` producer only takes `&str` names, and the point is to write names that are not
/// UTF-8, as any non-Java producer can.
#[cfg(feature = "test-support")]
pub mod produce {
    use std::ffi::{CStr, CString};
    use std::sync::Mutex;
    use std::time::Duration;

    use anyhow::{anyhow, bail, Context as _};
    use rdkafka::client::ClientContext;
    use rdkafka::message::Message as _;
    use rdkafka::producer::{BaseProducer, DeliveryResult, Producer as _, ProducerContext};
    use rdkafka_sys as sys;

    /// Records each delivery report: the offset, or the error.
    #[derive(Default)]
    struct Reports(Mutex<Vec<Result<i64, String>>>);

    impl ClientContext for Reports {}

    impl ProducerContext for Reports {
        type DeliveryOpaque = ();
        fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
            let report = match result {
                Ok(m) => Ok(m.offset()),
                Err((e, _)) => Err(e.to_string()),
            };
            self.0.lock().expect("reports lock").push(report);
        }
    }

    /// Produces one record to `topic`/`partition` with `headers` (names as bytes, without
    /// NUL) through a new idempotent producer, waits for it, and returns its offset.
    pub fn produce_with_raw_headers(
        bootstrap: &str,
        topic: &str,
        partition: i32,
        key: &[u8],
        value: Option<&[u8]>,
        headers: &[(&[u8], Option<&[u8]>)],
        timeout: Duration,
    ) -> anyhow::Result<i64> {
        let producer: BaseProducer<Reports> =
            crate::kafka::producer_config(bootstrap).create_with_context(Reports::default()).context("producer")?;
        let topic_c = CString::new(topic).map_err(|_| anyhow!("topic name {topic:?} contains NUL"))?;
        let names = headers
            .iter()
            .map(|(n, _)| CString::new(*n).map_err(|_| anyhow!("header name {n:?} contains NUL")))
            .collect::<anyhow::Result<Vec<CString>>>()?;
        let vu = |vtype, u| sys::rd_kafka_vu_t { vtype, u };
        use sys::rd_kafka_vtype_t as T;
        use sys::rd_kafka_vu_s__bindgen_ty_1 as U;
        let mut vus = vec![
            vu(T::RD_KAFKA_VTYPE_TOPIC, U { cstr: topic_c.as_ptr() }),
            vu(T::RD_KAFKA_VTYPE_PARTITION, U { i32_: partition }),
            vu(T::RD_KAFKA_VTYPE_MSGFLAGS, U { i: sys::RD_KAFKA_MSG_F_COPY }),
            vu(
                T::RD_KAFKA_VTYPE_KEY,
                U {
                    mem: sys::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                        ptr: key.as_ptr() as *mut _,
                        size: key.len(),
                    },
                },
            ),
        ];
        if let Some(v) = value {
            let mem = sys::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 { ptr: v.as_ptr() as *mut _, size: v.len() };
            vus.push(vu(T::RD_KAFKA_VTYPE_VALUE, U { mem }));
        }
        for (name, (_, value)) in names.iter().zip(headers) {
            let header = sys::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                name: name.as_ptr(),
                val: value.map_or(std::ptr::null(), |v| v.as_ptr().cast()),
                size: value.map_or(0, |v| v.len() as isize),
            };
            vus.push(vu(T::RD_KAFKA_VTYPE_HEADER, U { header }));
        }
        // SAFETY: the producer's handle is live for the call; every pointer in `vus` points
        // into `topic_c`, `names`, `key`, `value` or `headers`, all alive across the call,
        // and `RD_KAFKA_MSG_F_COPY` makes librdkafka copy key and value (it always copies
        // topic names and headers). No opaque is passed, and the context's opaque type is
        // `()`, which ignores it.
        let error = unsafe { sys::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len()) };
        if !error.is_null() {
            // SAFETY: a non-null error is ours: read its NUL-terminated message, then destroy it.
            let message = unsafe { CStr::from_ptr(sys::rd_kafka_error_string(error)) }.to_string_lossy().into_owned();
            // SAFETY: as above; destroyed exactly once.
            unsafe { sys::rd_kafka_error_destroy(error) };
            bail!("producing to {topic}/{partition}: {message}");
        }
        producer.flush(timeout).context("flushing the producer")?;
        let reports = std::mem::take(&mut *producer.context().0.lock().expect("reports lock"));
        match reports.as_slice() {
            [Ok(offset)] => Ok(*offset),
            [Err(e)] => bail!("producing to {topic}/{partition}: {e}"),
            other => bail!("expected one delivery report, got {other:?}"),
        }
    }
}
