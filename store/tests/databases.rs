//! The statements on whole databases, against the real server: a database is created, seen,
//! and dropped while a session is connected to it. (The statements on the schema run in the
//! projector's and the gateway's integration tests.)

use std::str::FromStr as _;

use parsley_store::database::{self, DatabaseName};
use parsley_testkit::{database_url, unique};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions as _, Connection as _};

#[tokio::test]
async fn a_database_is_created_seen_and_dropped() {
    let options = PgConnectOptions::from_str(&database_url()).unwrap();
    let mut server = options.clone().database("postgres").connect().await.unwrap();
    let name = DatabaseName::new(&unique("store_db").to_ascii_lowercase().replace(['-', '.'], "_")).unwrap();
    assert!(!database::exists(&mut server, &name).await.unwrap());
    database::create(&mut server, &name).await.unwrap();
    assert!(database::exists(&mut server, &name).await.unwrap());
    let err = format!("{:#}", database::create(&mut server, &name).await.unwrap_err());
    assert!(err.contains(name.as_str()), "{err}");
    // A session on it does not keep it from being dropped.
    let session = options.clone().database(name.as_str()).connect().await.unwrap();
    database::drop_forced(&mut server, &name).await.unwrap();
    assert!(!database::exists(&mut server, &name).await.unwrap());
    drop(session);
    server.close().await.unwrap();
}
