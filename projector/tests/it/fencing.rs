//! Fencing: a second instance taking a task makes the first one's next commit fail, and the
//! first stops touching the task.

use parsley_projector::task::{StepOutcome, TaskState};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_owner_fences_the_first() {
    let n = Names::new("fence");
    create_topics(&[&n.orders, &n.payments], 1).await;
    let pool = pool().await;
    let plain = producer();
    let first_at = produce(&plain, &n.orders, 0, "o1", Some(br#"{"v":1}"#), None).await;

    let config_a = n.config();
    let mut a = start(&config_a, &pool, Recording::new(&config_a)).await;
    drive_until(&mut a, "the first record to apply", || async { document(&pool, &n.model, "o1").await.is_some() })
        .await;
    let epoch_a = a.tasks()[0].epoch();

    let config_b = n.config(); // another owner name
    let mut b = start(&config_b, &pool, Recording::new(&config_b)).await;
    assert_eq!(b.tasks()[0].epoch(), epoch_a + 1);
    let r = report(&pool, &n.model).await;
    assert_eq!(r.task(0).unwrap().owner, config_b.owner());

    let second_at = produce(&plain, &n.orders, 0, "o2", Some(br#"{"v":2}"#), None).await;
    // A polls the new record and tries to commit it: the epoch check rejects the step.
    let mut outcome = StepOutcome::Idle;
    for _ in 0..50 {
        outcome = a.tasks_mut()[0].run_once().await;
        if outcome != StepOutcome::Idle {
            break;
        }
    }
    assert_eq!(outcome, StepOutcome::Fenced);
    assert_eq!(a.tasks()[0].state(), &TaskState::Fenced);
    assert_eq!(a.tasks_mut()[0].run_once().await, StepOutcome::Fenced, "the fenced owner never steps again");
    assert_eq!(document(&pool, &n.model, "o2").await, None, "nothing of the fenced step was committed");

    drive_until(&mut b, "the new owner to apply the second record", || async {
        document(&pool, &n.model, "o2").await.is_some()
    })
    .await;
    assert_eq!(
        applied(&pool, &n.model).await,
        vec![(n.orders.clone(), 0, first_at), (n.orders.clone(), 0, second_at)],
        "the first record once (by A), the second once (by B)"
    );
}
